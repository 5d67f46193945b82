"""The application's configuration: one pydantic model, validated where the app is built.

``build_app(args)`` (the ``args:`` of a Serve YAML) goes through ``TRServeConfig.from_args``, which
rejects unknown keys and bad values with a message naming the key, so a typo stops the deployment
instead of being dropped. As in Ray Serve LLM, the engine's settings are nested under
``engine_kwargs``: that is ``tr_serve.engine.config.EngineConfig`` itself (declared and validated
there, once), with ``model`` at the top level; the Serve fields are passed to
``serve.deployment(...).options(...)`` for the model server.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from tr_serve.engine.config import DEFAULT_MODEL, EngineConfig
from tr_serve.fleet.config import FleetSyncConfig
from tr_serve.tp.placement import (DEFAULT_CPU_WORKER_CPUS, DEFAULT_GPU_WORKER_CPUS, DEFAULT_INIT_TIMEOUT_S,
                                   DEFAULT_STEP_TIMEOUT_S, torch_threads, with_worker_cpus)

API_KEYS_ENV = "TR_SERVE_API_KEYS"

PROMPT_CHARS_PER_TOKEN = 64  # characters per token of max_model_len a prompt may have before it is tokenized
BODY_BYTES_PER_CHAR = 4  # JSON-escaped text takes up to 6 bytes a character, UTF-8 up to 4; most takes 1
BODY_OVERHEAD_BYTES = 64 * 1024  # fields other than the prompt
INGRESS_SHUTDOWN_MARGIN_S = 5.0  # the ingress outlives the model server's drain by this much



ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


class ConfigError(ValueError):
    """A bad application config; the message names every offending key."""


def env_api_keys() -> list[str]:
    """Keys from ``TR_SERVE_API_KEYS`` (comma-separated; blanks ignored)."""
    raw = os.environ.get(API_KEYS_ENV, "")
    return [k.strip() for k in raw.split(",") if k.strip()]


class IngressConfig(BaseModel):
    """Options of the HTTP ingress deployment (routing, auth, SSE framing; no model)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: Optional[Union[int, Literal["auto"]]] = Field(default=1)
    autoscaling_config: Optional[dict[str, Any]] = None
    max_ongoing_requests: int = Field(default=1024, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0})

    @field_validator("num_replicas")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling(cls, v):
        return _check_autoscaling(v)

    @model_validator(mode="after")
    def _scaling(self):
        _check_scaling(self.num_replicas, self.autoscaling_config, self.model_fields_set)
        return self



class TRServeConfig(BaseModel):
    """Arguments of ``tr_serve.serve.builder:build_app``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- model and engine ---------------------------------------------------------------------
    model: str = Field(default=DEFAULT_MODEL, min_length=1,
                       description="directory, .gguf file, hub id, or the embedded alias")
    model_id: Optional[str] = Field(default=None, min_length=1,
                                    description="name clients send in `model`; default: `model`")
    engine_kwargs: EngineConfig = Field(
        default_factory=EngineConfig, description="the engine's settings (tr_serve.engine.config.EngineConfig: "
                                                  "tree, k, max_num_seqs, max_model_len, device, dtype, budget, ...) "
                                                  "but `model`, validated by the engine's own checks")
    cpu_threads: Optional[int] = Field(
        default=None, ge=1, description="torch.set_num_threads in the model replica; default: the CPUs it reserves "
                                        "(ray_actor_options.num_cpus, else placement_group_bundles[0].CPU), rounded "
                                        "down, at least 1; it may not exceed them (rounded up)")
    fleet: FleetSyncConfig = Field(default_factory=FleetSyncConfig,
                                   description="fleet-wide hot start: replicas share one adjacency matrix (tr_serve.fleet)")
    tensor_parallel_size: int = Field(default=1, ge=1, description="ranks the model is split over (tr_serve.tp); "
                                      "> 1: Ray actors in the last N placement group bundles, or a group of their own")
    init_timeout_s: float = Field(
        default=DEFAULT_INIT_TIMEOUT_S, gt=0, allow_inf_nan=False,
        description="tensor parallel: how long the replica's start-up may take (placing the workers, each reading "
                    "its shard of the weights, downloads included, the process group and its warm-up all-reduce) "
                    "before it fails; raise it for a large checkpoint that is not on local disk yet")
    step_timeout_s: float = Field(
        default=DEFAULT_STEP_TIMEOUT_S, gt=0, allow_inf_nan=False,
        description="tensor parallel: how long one forward on every worker may take before the runner fails and "
                    "Serve replaces the replica (NCCL is set up within init_timeout_s, not in a first forward)")
    worker_cpus: Optional[float] = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="tensor parallel: CPUs each worker reserves in its placement group bundle, and its torch "
                    "threads (rounded down, at least 1); default: its bundle's CPU, and a worker bundle that names "
                    f"no CPU gets {DEFAULT_GPU_WORKER_CPUS:g} on CUDA, {DEFAULT_CPU_WORKER_CPUS:g} on CPU")

    # ---- HTTP API ---------------------------------------------------------------------------
    api_keys: list[SecretStr] = Field(default_factory=list,
                                      description=f"Bearer keys; also {API_KEYS_ENV} (comma-separated)")
    allow_unauthenticated: bool = Field(
        default=False, description="let `tr-serve run` start with no API key configured while Serve's HTTP host "
                                   "is not loopback (the API is then open to whoever reaches the port)")
    tenants: dict[str, list[SecretStr]] = Field(
        default_factory=dict, description="tenant name -> the API keys that are that one tenant (what one tenant "
                                          "sends never shapes what another observes); every other key is a tenant "
                                          "of its own")
    isolation: Literal["tenant", "none"] = Field(
        default="tenant", description="'tenant': each tenant's text drafts for its own requests only; 'none': one "
                                      "shared scope for every key (every caller trusts every other)")
    default_max_tokens: Optional[int] = Field(
        default=None, ge=1, description="tokens a request that sends no max_tokens may generate, at most the context "
                                        "left; default: the context left (max_model_len minus the prompt)")
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    max_prompt_chars: Optional[int] = Field(
        default=None, ge=1, description="characters of prompt text a request may carry, checked before tokenizing; "
                                        f"default {PROMPT_CHARS_PER_TOKEN} * max_model_len")
    max_request_bytes: Optional[int] = Field(
        default=None, ge=1024, description="HTTP request body size limit, checked before the body is parsed; "
                                           f"default {BODY_BYTES_PER_CHAR} * max_prompt_chars + {BODY_OVERHEAD_BYTES}")
    max_json_depth: int = Field(default=32, ge=4, le=256,
                                description="nesting of objects and arrays a request body may have")
    startup_wait_s: float = Field(
        default=60.0, ge=0, allow_inf_nan=False,
        description="a request for a model whose first replica is still loading waits this long for it, then gets "
                    "503 (code model_loading) with Retry-After; 0: the 503 at once. Until then /v1/models does not "
                    "list the model and /health answers 503")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="on drain (SIGINT/SIGTERM to `tr-serve run`, a replaced replica): how long "
                                        "in-flight requests may take to finish before they end with an error")
    queue_timeout_s: Optional[float] = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="a request no model replica has taken within this many seconds of the ingress sending it is "
                    "cancelled and gets 503 (code queue_timeout) with Retry-After; default: it waits")
    max_concurrent_requests_per_key: Optional[int] = Field(
        default=None, ge=1,
        description="generation requests one API key (or one `tenants` group, its keys together) may have in "
                    "flight at once; one more gets 429 (code too_many_requests) with Retry-After. Counted per "
                    "ingress replica; with no key configured, every request is one caller. Default: no cap")

    # ---- model server deployment (Ray Serve options) ---------------------------------------
    num_replicas: Optional[Union[int, Literal["auto"]]] = 1
    autoscaling_config: Optional[dict[str, Any]] = None
    max_ongoing_requests: Optional[int] = Field(default=None, ge=1,
                                                description="per replica; default 2 * max_num_seqs")
    max_queued_requests: Optional[int] = Field(default=None, ge=-1,
                                               description="per caller; -1 = unbounded; default 8 * max_num_seqs")
    backpressure_status_code: Literal[429, 503] = 429
    retry_after_s: float = Field(default=1.0, ge=0)
    ray_actor_options: Optional[dict[str, Any]] = None
    placement_group_bundles: Optional[list[dict[str, float]]] = None
    placement_group_strategy: Optional[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]] = None
    health_check_period_s: Optional[float] = Field(default=None, gt=0)
    health_check_timeout_s: Optional[float] = Field(default=None, gt=0)
    graceful_shutdown_timeout_s: Optional[float] = Field(default=None, ge=0)

    # ---- validators -------------------------------------------------------------------------
    @field_validator("engine_kwargs", mode="before")
    @classmethod
    def _engine_model(cls, v):
        if isinstance(v, dict) and "model" in v:
            raise ValueError("`model` is set at the top level of the config, not in engine_kwargs")
        return v

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_tree(cls, v: EngineConfig) -> EngineConfig:
        from tr_serve.tr.tree_spec import validate_tree_spec

        validate_tree_spec(v.tree, v.k, v.budget)  # the template loads: a ValueError that names the problem
        return v

    @field_validator("num_replicas")
    @classmethod
    def _replicas(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling(cls, v):
        return _check_autoscaling(v)

    @field_validator("placement_group_bundles")
    @classmethod
    def _bundles(cls, v):
        if v is not None and len(v) == 0:
            raise ValueError("give at least one bundle, e.g. [{GPU: 1}]")
        return v

    @model_validator(mode="after")
    def _cross(self):
        _check_scaling(self.num_replicas, self.autoscaling_config, self.model_fields_set)
        if self.placement_group_strategy is not None and self.placement_group_bundles is None:
            raise ValueError("placement_group_strategy needs placement_group_bundles")
        tp, bundles = self.tensor_parallel_size, self.placement_group_bundles
        if tp > 1 and self.engine_kwargs.compile:
            raise ValueError(f"tensor_parallel_size={tp}: the ranks' compact decoder runs eagerly, engine_kwargs "
                             "compile is not supported under tensor parallelism yet")
        if tp > 1 and bundles is not None and len(bundles) < tp:
            raise ValueError(f"tensor_parallel_size={tp} needs at least {tp} placement_group_bundles (one per "
                             f"worker, plus one first for the replica), got {len(bundles)}")
        self.resolved_placement_group_bundles()  # worker_cpus fits every worker bundle (ValueError naming it)
        cpus = self.replica_cpus()
        if self.cpu_threads is not None and cpus is not None and self.cpu_threads > max(1, math.ceil(cpus)):
            raise ValueError(f"cpu_threads={self.cpu_threads} exceeds the {cpus:g} CPU(s) the model replica reserves "
                             "(ray_actor_options.num_cpus, else placement_group_bundles[0].CPU): reserve more CPUs "
                             "there or lower cpu_threads")
        return self

    # ---- derived ----------------------------------------------------------------------------
    @property
    def served_model_id(self) -> str:
        return self.model_id or self.model

    def engine_config(self) -> EngineConfig:
        """``engine_kwargs`` with the top-level ``model``: what the replica's engine is built with."""
        return dataclasses.replace(self.engine_kwargs, model=self.model)

    def replica_cpus(self) -> float | None:
        """The logical CPUs the model replica reserves, where the config says (``ray_actor_options``'s
        ``num_cpus``, else bundle 0's ``CPU``, where it lives); None: Serve's default."""
        actor = self.ray_actor_options or {}
        if "num_cpus" in actor:
            return float(actor["num_cpus"])
        if self.placement_group_bundles:
            return float(self.placement_group_bundles[0].get("CPU", 0))
        return None

    def resolved_cpu_threads(self) -> int | None:
        """The replica's torch threads: ``cpu_threads``, else its reserved CPUs (Ray's rule for
        ``OMP_NUM_THREADS``, made explicit); None: torch's default."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        cpus = self.replica_cpus()
        return torch_threads(cpus) if cpus is not None else None

    def resolved_placement_group_bundles(self) -> list[dict[str, float]] | None:
        """``placement_group_bundles`` with the tensor-parallel workers' CPUs filled in
        (``tr_serve.tp.placement.with_worker_cpus``): what Serve reserves."""
        if self.placement_group_bundles is None:
            return None
        return with_worker_cpus(self.placement_group_bundles, self.tensor_parallel_size,
                                self.engine_kwargs.device.startswith("cuda"), self.worker_cpus)

    def resolved_max_prompt_chars(self) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.engine_kwargs.max_model_len

    def resolved_max_request_bytes(self) -> int:
        return self.max_request_bytes or BODY_BYTES_PER_CHAR * self.resolved_max_prompt_chars() + BODY_OVERHEAD_BYTES

    def resolved_tenants(self) -> dict[str, list[str]]:
        return {name: sorted(k.get_secret_value() for k in keys) for name, keys in self.tenants.items()}

    def resolved_api_keys(self, include_env: bool = True) -> list[str]:
        """Every key that authenticates: ``api_keys``, the env's and the ``tenants``' keys."""
        keys = [k.get_secret_value() for k in self.api_keys]
        keys += [k for ks in self.resolved_tenants().values() for k in ks]
        if include_env:
            keys += env_api_keys()
        return sorted(set(k for k in keys if k))

    def server_deployment_options(self) -> dict[str, Any]:
        """Options for ``serve.deployment(LLMServer).options(**...)``."""
        seqs = self.engine_kwargs.max_num_seqs
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests or 2 * seqs,
            "max_queued_requests": self.max_queued_requests if self.max_queued_requests is not None else 8 * seqs,
            "backpressure_config": {"status_code": self.backpressure_status_code,
                                    "retry_after_s": self.retry_after_s},
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config
        else:
            opts["num_replicas"] = self.num_replicas
        actor = dict(self.ray_actor_options or {})
        first_bundle = self.placement_group_bundles[0] if self.placement_group_bundles else None
        if self.engine_kwargs.device.startswith("cuda") and "num_gpus" not in actor:
            actor["num_gpus"] = 1 if first_bundle is None else min(1, first_bundle.get("GPU", 0))
        if first_bundle is not None and "num_cpus" not in actor:
            # the replica actor lives in the first bundle: by default it takes that bundle's CPUs
            # (Serve's default of 1 CPU would not fit a {GPU: 1} bundle)
            actor["num_cpus"] = first_bundle.get("CPU", 0)
        if actor:
            opts["ray_actor_options"] = actor
        if self.placement_group_bundles is not None:
            opts["placement_group_bundles"] = self.resolved_placement_group_bundles()
            opts["placement_group_strategy"] = self.placement_group_strategy or "PACK"
        for name in ("health_check_period_s", "health_check_timeout_s"):
            value = getattr(self, name)
            if value is not None:
                opts[name] = value
        # a replica Serve replaces (redeploy, downscale) lets its requests finish for drain_timeout_s
        opts["graceful_shutdown_timeout_s"] = (self.graceful_shutdown_timeout_s
                                               if self.graceful_shutdown_timeout_s is not None else self.drain_timeout_s)
        return opts

    def ingress_deployment_options(self) -> dict[str, Any]:
        ing = self.ingress
        # the ingress outlives the model server's drain, so it can still frame the in-band error event
        grace = self.server_deployment_options()["graceful_shutdown_timeout_s"] + INGRESS_SHUTDOWN_MARGIN_S
        opts: dict[str, Any] = {"max_ongoing_requests": ing.max_ongoing_requests,
                                "ray_actor_options": dict(ing.ray_actor_options),
                                "graceful_shutdown_timeout_s": grace}
        if ing.autoscaling_config is not None:
            opts["autoscaling_config"] = ing.autoscaling_config
        else:
            opts["num_replicas"] = ing.num_replicas
        return opts

    @classmethod
    def from_args(cls, args: "TRServeConfig | dict[str, Any] | None") -> "TRServeConfig":
        """Validate ``args``; raise ConfigError naming each bad key."""
        if isinstance(args, cls):
            return args
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ConfigError(f"tr_serve config must be a mapping of keys to values, got {type(args).__name__}")
        try:
            return cls.model_validate(args)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e)) from None


def _check_scaling(num_replicas, autoscaling_config, fields_set) -> None:
    if autoscaling_config is not None and "num_replicas" in fields_set and num_replicas not in (None, "auto"):
        raise ValueError("give either num_replicas or autoscaling_config, not both")


def _check_autoscaling(value):
    if value is None:
        return value
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; Serve's autoscaling_config takes "
                         f"{sorted(AutoscalingConfig.model_fields)}")
    try:
        AutoscalingConfig.model_validate(value)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else _strip(err["msg"])
            parts.append(f"{key}: {msg}" if key else msg)
        raise ValueError("; ".join(parts)) from None
    return value


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        msg = _strip(err["msg"])
        if err["type"] == "unexpected_keyword_argument":
            msg = "unknown key (not a tr_serve.engine.config.EngineConfig field)"
        elif err["type"] == "extra_forbidden":
            msg = "unknown key (not a tr_serve config field)"
            if key in ENGINE_FIELDS:
                msg += f"; engine settings go under engine_kwargs: {{{key}: ...}}"
        lines.append(f"{key}: {msg}")
    return "invalid tr_serve config: " + "; ".join(lines)


def _strip(msg: str) -> str:
    while msg.startswith(("Value error, ", "Assertion failed, ")):
        msg = msg.split(", ", 1)[1]
    return msg
