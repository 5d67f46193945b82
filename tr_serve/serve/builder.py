"""Application builders, following ``ray.serve.llm``'s layout: ingress -> model server -> engine.

``build_app`` is the Serve YAML entry point::

    applications:
      - import_path: tr_serve.serve.builder:build_app
        args: {model: smollm2-135m-instruct, engine_kwargs: {tree: top4}, ...}   # TRServeConfig

It validates ``args`` first (an unknown key or a bad value raises ``ConfigError`` naming it, which
stops the deployment), then binds one ``LLMServer`` deployment and the ``OpenAIIngress`` in front.
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

from ray import serve
from ray.serve.deployment import Application

from tr_serve.serve.config import ConfigError, TRServeConfig
from tr_serve.serve.ingress import OpenAIIngress
from tr_serve.serve.protocol import model_card
from tr_serve.serve.server import LLMServer

SERVER_NAME_PREFIX = "LLMServer:"
INGRESS_NAME = "OpenAIIngress"


def deployment_name(model_id: str, prefix: str = SERVER_NAME_PREFIX) -> str:
    return prefix + re.sub(r"[^A-Za-z0-9_.:-]+", "-", model_id)


def build_llm_deployment(config: TRServeConfig | dict, name_prefix: str = SERVER_NAME_PREFIX) -> Application:
    """One model server deployment bound to its (validated) config."""
    config = TRServeConfig.from_args(config)
    try:
        deployment = serve.deployment(LLMServer).options(  # type: ignore[attr-defined]  # Ray's decorator type
            name=deployment_name(config.served_model_id, name_prefix), **config.server_deployment_options())
    except (ValueError, TypeError) as e:  # Serve's own checks (placement group vs actor resources, ...)
        raise ConfigError("invalid tr_serve config: ray_actor_options / placement_group_bundles / Serve options "
                          f"of the model server are rejected: {e}") from None
    return deployment.bind(config.model_copy(update={"api_keys": [], "tenants": {}}))  # keys stay at the edge


def build_openai_app(configs: Sequence[TRServeConfig | dict],
                     ingress_config: TRServeConfig | None = None) -> Application:
    """Ingress in front of one model server per config (model ids must be distinct). The ingress
    options, JSON depth, drain timeout, start-up wait, queue timeout and per-key concurrency cap come
    from ``ingress_config`` (default: the first config); the body size limit is the largest of the
    configs', the prompt character bound is per model."""
    configs = [TRServeConfig.from_args(c) for c in configs]
    if not configs:
        raise ConfigError("invalid tr_serve config: no model to serve")
    ids = [c.served_model_id for c in configs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"invalid tr_serve config: model_id values must be distinct, got {ids}")
    edge = ingress_config or configs[0]
    created = int(time.time())
    servers = {c.served_model_id: build_llm_deployment(c) for c in configs}
    cards = {c.served_model_id: model_card(c.served_model_id, created, c.engine_kwargs.max_model_len, c.model)
             for c in configs}
    tenants: dict[str, list[str]] = {}
    for c in configs:
        for name, group in c.resolved_tenants().items():
            tenants[name] = sorted(set(tenants.get(name, [])) | set(group))
    keys = sorted(set(k for c in configs for k in c.resolved_api_keys()))
    limits = {"max_request_bytes": max(c.resolved_max_request_bytes() for c in configs),
              "max_json_depth": edge.max_json_depth, "drain_timeout_s": edge.drain_timeout_s,
              "startup_wait_s": edge.startup_wait_s, "queue_timeout_s": edge.queue_timeout_s,
              "max_concurrent_requests_per_key": edge.max_concurrent_requests_per_key,
              "max_prompt_chars": {c.served_model_id: c.resolved_max_prompt_chars() for c in configs}}
    try:
        ingress = serve.deployment(OpenAIIngress).options(  # type: ignore[attr-defined]  # Ray's decorator type
            name=INGRESS_NAME, **edge.ingress_deployment_options())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid tr_serve config: ingress options are rejected: {e}") from None
    return ingress.bind(llm_deployments=servers, model_cards=cards, api_keys=keys, limits=limits,
                        tenants=tenants, isolation=edge.isolation)


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (``import_path: tr_serve.serve.builder:build_app``); ``args`` is a
    ``TRServeConfig`` as a dict (or the model itself)."""
    return build_openai_app([TRServeConfig.from_args(args)])
