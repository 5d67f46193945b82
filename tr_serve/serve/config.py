"""The application's configuration: one pydantic model, validated where the app is built.

``build_app(args)`` (the ``args:`` of a Serve YAML) goes through ``TRServeConfig.from_args``, which
rejects unknown keys and bad values with a message naming the key, so a typo stops the deployment
instead of being dropped. Engine fields map 1:1 onto ``tr_serve.engine.config.EngineConfig``;
the Serve fields are passed to ``serve.deployment(...).options(...)`` for the model server.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from tr_serve.fleet.config import FleetSyncConfig

API_KEYS_ENV = "TR_SERVE_API_KEYS"

PROMPT_CHARS_PER_TOKEN = 64  # characters per token of max_model_len a prompt may have before it is tokenized
BODY_BYTES_PER_CHAR = 4  # JSON-escaped text takes up to 6 bytes a character, UTF-8 up to 4; most takes 1
BODY_OVERHEAD_BYTES = 64 * 1024  # fields other than the prompt
INGRESS_SHUTDOWN_MARGIN_S = 5.0  # the ingress outlives the model server's drain by this much

_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


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

    # ---- model and engine (tr_serve.engine.config.EngineConfig) ----------------------------
    model: str = Field(default="smollm2-135m-instruct", min_length=1,
                       description="directory, .gguf file, hub id, or the embedded alias")
    model_id: Optional[str] = Field(default=None, min_length=1,
                                    description="name clients send in `model`; default: `model`")
    # k comes before tree: the tree is checked against it
    k: int = Field(default=8, ge=1, description="matrix candidates per token")
    tree: str = Field(default="auto", min_length=1, description="'auto' (cost-aware hybrid), a template name or JSON file, '<template>+ctx' (hybrid), 'pld', or 'none'")
    max_num_seqs: int = Field(default=8, ge=1)
    max_model_len: int = Field(default=2048, ge=2)
    device: str = "cpu"
    dtype: str = "auto"
    prompt_seeding: bool = True
    budget: Literal["fixed", "auto"] = Field(
        default="fixed", description="tree budget: 'fixed' = whole template, 'auto' = cost-aware prefix per step")
    max_prefill_tokens: int = Field(default=512, ge=1, description="prompt tokens per prefill step (chunked prefill)")
    kv_cache_memory_gb: Optional[float] = Field(default=None, gt=0,
                                                description="caps KV rows x max_model_len; default: max_num_seqs rows")
    cpu_threads: Optional[int] = Field(default=None, ge=1, description="torch.set_num_threads in the model replica")
    cpu_kernels: Literal["auto", "torch"] = Field(
        default="auto", description="float32 on CPU: 'auto' = fastest measured linear kernel per token count, "
                                    "'torch' = torch's F.linear")
    fleet: FleetSyncConfig = Field(default_factory=FleetSyncConfig,
                                   description="fleet-wide hot start: replicas share one adjacency matrix (tr_serve.fleet)")
    tensor_parallel_size: int = Field(default=1, ge=1, description="ranks the model is split over (tr_serve.tp); "
                                      "> 1: Ray actors in the last N placement group bundles, or a group of their own")
    init_timeout_s: float = Field(
        default=600.0, gt=0, description="tensor parallel: how long the replica's start-up may take (placing the "
                                         "workers, each reading its shard of the weights, downloads included, "
                                         "the process group, the kernel plan) before it fails; raise it for a "
                                         "large checkpoint that is not on local disk yet")

    # ---- HTTP API ---------------------------------------------------------------------------
    api_keys: list[SecretStr] = Field(default_factory=list,
                                      description=f"Bearer keys; also {API_KEYS_ENV} (comma-separated)")
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    max_prompt_chars: Optional[int] = Field(
        default=None, ge=1, description="characters of prompt text a request may carry, checked before tokenizing; "
                                        f"default {PROMPT_CHARS_PER_TOKEN} * max_model_len")
    max_request_bytes: Optional[int] = Field(
        default=None, ge=1024, description="HTTP request body size limit, checked before the body is parsed; "
                                           f"default {BODY_BYTES_PER_CHAR} * max_prompt_chars + {BODY_OVERHEAD_BYTES}")
    max_json_depth: int = Field(default=32, ge=4, le=256,
                                description="nesting of objects and arrays a request body may have")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="on drain (SIGINT/SIGTERM to `tr-serve run`, a replaced replica): how long "
                                        "in-flight requests may take to finish before they end with an error")

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
    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _DEVICE.match(v):
            raise ValueError(f"unknown device {v!r}: use cpu, cuda, cuda:N or mps")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}: use one of {list(_DTYPES)}")
        return v

    @field_validator("tree")
    @classmethod
    def _tree(cls, v: str, info: ValidationInfo) -> str:
        from tr_serve.tr.tree_spec import validate_tree_spec

        validate_tree_spec(v, info.data.get("k", 8))  # a ValueError that names the problem
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
        try:
            self.engine_config()
        except (TypeError, ValueError) as e:  # the engine's own checks
            raise ValueError(f"engine config: {e}") from None
        if self.placement_group_strategy is not None and self.placement_group_bundles is None:
            raise ValueError("placement_group_strategy needs placement_group_bundles")
        tp, bundles = self.tensor_parallel_size, self.placement_group_bundles
        if tp > 1 and bundles is not None and len(bundles) < tp:
            raise ValueError(f"tensor_parallel_size={tp} needs at least {tp} placement_group_bundles (one per "
                             f"worker, plus one first for the replica), got {len(bundles)}")
        return self

    # ---- derived ----------------------------------------------------------------------------
    @property
    def served_model_id(self) -> str:
        return self.model_id or self.model

    def engine_config(self):
        from tr_serve.engine.config import EngineConfig

        return EngineConfig(model=self.model, tree=self.tree, k=self.k, max_num_seqs=self.max_num_seqs,
                            max_model_len=self.max_model_len, device=self.device, dtype=self.dtype,
                            prompt_seeding=self.prompt_seeding, max_prefill_tokens=self.max_prefill_tokens,
                            kv_cache_memory_gb=self.kv_cache_memory_gb, budget=self.budget,
                            cpu_kernels=self.cpu_kernels)

    def resolved_max_prompt_chars(self) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_model_len

    def resolved_max_request_bytes(self) -> int:
        return self.max_request_bytes or BODY_BYTES_PER_CHAR * self.resolved_max_prompt_chars() + BODY_OVERHEAD_BYTES

    def resolved_api_keys(self, include_env: bool = True) -> list[str]:
        keys = [k.get_secret_value() for k in self.api_keys]
        if include_env:
            keys += env_api_keys()
        return sorted(set(k for k in keys if k))

    def server_deployment_options(self) -> dict[str, Any]:
        """Options for ``serve.deployment(LLMServer).options(**...)``."""
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests or 2 * self.max_num_seqs,
            "max_queued_requests": self.max_queued_requests if self.max_queued_requests is not None
            else 8 * self.max_num_seqs,
            "backpressure_config": {"status_code": self.backpressure_status_code,
                                    "retry_after_s": self.retry_after_s},
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config
        else:
            opts["num_replicas"] = self.num_replicas
        actor = dict(self.ray_actor_options or {})
        first_bundle = self.placement_group_bundles[0] if self.placement_group_bundles else None
        if self.device.startswith("cuda") and "num_gpus" not in actor:
            actor["num_gpus"] = 1 if first_bundle is None else min(1, first_bundle.get("GPU", 0))
        if first_bundle is not None and "num_cpus" not in actor:
            # the replica actor lives in the first bundle: by default it takes that bundle's CPUs
            # (Serve's default of 1 CPU would not fit a {GPU: 1} bundle)
            actor["num_cpus"] = first_bundle.get("CPU", 0)
        if actor:
            opts["ray_actor_options"] = actor
        if self.placement_group_bundles is not None:
            opts["placement_group_bundles"] = self.placement_group_bundles
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
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a tr_serve config field)"
        lines.append(f"{key}: {msg}")
    return "invalid tr_serve config: " + "; ".join(lines)


def _strip(msg: str) -> str:
    while msg.startswith(("Value error, ", "Assertion failed, ")):
        msg = msg.split(", ", 1)[1]
    return msg
