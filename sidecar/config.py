"""Every setting in one frozen dataclass; CLI flags and environment variables map onto it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Config:
    # model
    model: str = "builtin:tiny"
    kv_dtype: str = "auto"  # auto (the model's dtype) | float16 | bfloat16 | float32 | 8bit | 4bit (quantised)
    max_model_len: int = 0  # 0: from the model's config (max_position_embeddings), capped at 32768
    seed: int = 0
    runner: str = "auto"  # auto (pooling where the model directory declares it) | generate | pooling
    # device and memory
    device: str = "auto"  # auto | gpu | cpu
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    # the profile run and warm-up shapes (the scheduler's limits)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_logprobs: int = 20
    # bounds on what one scheduler can make the worker hold (400 past them; docs/protocol.md)
    max_live_requests: int = 1024
    max_req_id_len: int = 256
    max_encoder_cache_bytes: int = 4 << 30  # image encoder outputs held until the scheduler frees them
    decode_ahead: bool = True  # overlap the next decode forward with the RPC round trip
    # speculative decoding (vLLM's speculative_config): drafts proposed by the worker, handed out by
    # take_draft_token_ids and verified when the scheduler sends them back (engine/proposers.py)
    speculative_method: str = "none"  # none | ngram | draft_model (implied by draft_model)
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    speculative_verify_cost: float = -1.0  # ngram: a verified draft's cost per decode step; < 0: measured
    draft_model: str | None = None  # a small mlx-lm model with the target's vocabulary
    # server
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    auth_token_file: str | None = None
    auth_token: str | None = field(default=None, repr=False)  # from MLX_SIDECAR_AUTH_TOKEN
    allow_insecure: bool = False
    protect_metrics: bool = False
    max_body_bytes: int = 64 * 1024 * 1024
    max_queue: int = 64
    call_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    # per-connection bounds (server/connguard.py): a connection with no request is closed after
    # idle_timeout s, a request must arrive whole within read_timeout s, at most max_connections
    idle_timeout: float = 5.0
    read_timeout: float = 60.0
    max_connections: int = 512
    preload: bool = False  # run the lifecycle to `ready` at start-up
    lora_dir: str | None = None
    max_loras: int = 8
    # the disk KV tier (engine/kv_tier.py): full blocks kept on disk past eviction and restarts
    kv_store_dir: str | None = None
    kv_store_max_gb: float = 16.0
    log_level: str = "warning"
    log_format: str = "text"  # text | json
    home: str | None = None  # MLX_SIDECAR_HOME: where built-in models are generated
    # scale-out over mx.distributed (sidecar/distributed/): rank 0 serves, the others follow
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    distributed_backend: str = "ring"  # ring | jaccl | mpi | any (mx.distributed.init's backend)
    exit_on_rank_failure: bool = True  # rank 0 exits non-zero when a rank is lost (the service manager restarts)
    rank_timeout: float = 30.0  # a call's collectives unanswered this long = a lost rank (idle pings: min(3 s, this))
    heartbeat_interval: float = 1.0  # idle seconds between liveness pings over the group

    def replace(self, **overrides: Any) -> Config:
        """A copy with overrides; unknown keys or wrong types raise ConfigError naming the key."""
        known = {f.name: f for f in fields(self)}
        clean: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise ConfigError(key, f"unknown config key {key!r}")
            clean[key] = _coerce(key, known[key].type, value)
        cfg = dataclasses.replace(self, **clean)
        cfg.validate()
        return cfg

    def override(self, overrides: dict) -> Config:
        """init_device(config=...): only RUNTIME_OVERRIDES keys (a null value keeps the current
        setting); any other key is a ConfigError naming it."""
        for key, value in overrides.items():
            if key not in RUNTIME_OVERRIDES and not (key == "model" and _is_builtin(value)):
                hint = " (only a builtin:<name> model)" if key == "model" else ""
                raise ConfigError(key, f"config key {str(key)[:64]!r} cannot be set by init_device{hint}; it may set: "
                                  + ", ".join(sorted(RUNTIME_OVERRIDES | {"model"})))
        return self.replace(**{k: v for k, v in overrides.items() if v is not None})

    def validate(self) -> None:
        checks = [
            ("block_size", 1 <= self.block_size <= 1024, "must be in [1, 1024]"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", 1 <= self.max_num_batched_tokens <= 1 << 20, "must be in [1, 2^20]"),
            ("max_logprobs", self.max_logprobs >= 0, "must be >= 0"),
            ("max_live_requests", self.max_live_requests >= 1, "must be >= 1"),
            ("max_req_id_len", 1 <= self.max_req_id_len <= 1 << 20, "must be in [1, 2^20]"),
            ("max_encoder_cache_bytes", self.max_encoder_cache_bytes >= 1, "must be >= 1"),
            ("max_model_len", 0 <= self.max_model_len <= 1 << 20, "must be in [0, 2^20]"),
            ("kv_dtype", self.kv_dtype in ("auto", "float16", "bfloat16", "float32", "8bit", "4bit"),
             "must be auto|float16|bfloat16|float32|8bit|4bit"),
            ("device", self.device in ("auto", "gpu", "cpu"), "must be auto, gpu or cpu"),
            ("runner", self.runner in ("auto", "generate", "pooling"), "must be auto, generate or pooling"),
            ("log_format", self.log_format in ("text", "json"), "must be text or json"),
            ("max_queue", self.max_queue >= 1, "must be >= 1"),
            ("max_loras", self.max_loras >= 1, "must be >= 1"),
            ("call_timeout", self.call_timeout > 0, "must be > 0"),
            ("shutdown_timeout", self.shutdown_timeout > 0, "must be > 0"),
            ("idle_timeout", self.idle_timeout > 0, "must be > 0"),
            ("read_timeout", self.read_timeout > 0, "must be > 0"),
            ("max_connections", self.max_connections >= 1, "must be >= 1"),
            ("max_body_bytes", self.max_body_bytes >= 1, "must be >= 1"),
            ("log_level", self.log_level.lower() in LOG_LEVELS, "must be one of " + "|".join(LOG_LEVELS)),
            ("tensor_parallel", self.tensor_parallel >= 1, "must be >= 1"),
            ("pipeline_parallel", self.pipeline_parallel >= 1, "must be >= 1"),
            ("pipeline_parallel", self.tensor_parallel == 1 or self.pipeline_parallel == 1,
             "cannot be combined with tensor_parallel (mx.distributed's ring group cannot be split)"),
            ("distributed_backend", self.distributed_backend in ("ring", "jaccl", "mpi", "nccl", "any"),
             "must be ring, jaccl, mpi, nccl or any"),
            ("rank_timeout", self.rank_timeout > 0, "must be > 0"),
            ("heartbeat_interval", self.heartbeat_interval > 0, "must be > 0"),
            ("kv_store_max_gb", self.kv_store_max_gb > 0, "must be > 0"),
            ("kv_store_dir", not self.kv_store_dir or self.world_size == 1,
             "is not supported with tensor_parallel/pipeline_parallel (each rank holds a share of every block)"),
            ("speculative_method", self.world_size == 1 or self.spec_method == "none",
             "is not supported with tensor_parallel/pipeline_parallel (the verify step samples on every rank)"),
            ("speculative_method", self.speculative_method in ("none", "ngram", "draft_model"),
             "must be none, ngram or draft_model"),
            ("draft_model", self.spec_method != "draft_model" or bool(self.draft_model),
             "is needed for speculative_method draft_model"),
            ("num_speculative_tokens", 1 <= self.num_speculative_tokens <= 32, "must be in [1, 32]"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min, "must be >= prompt_lookup_min"),
            ("prompt_lookup_max", self.prompt_lookup_max <= 128, "must be <= 128"),  # each step's lookup ~ N x it
            ("speculative_verify_cost", -1.0 <= self.speculative_verify_cost <= 100.0, "must be in [-1, 100]"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ConfigError(key, f"{key} {why}, got {getattr(self, key)!r}")

    @property
    def world_size(self) -> int:
        """Ranks in the group (1: no scale-out)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def spec_method(self) -> str:
        """The speculative method in effect: a draft model alone implies draft_model."""
        if self.speculative_method == "none" and self.draft_model:
            return "draft_model"
        return self.speculative_method

    def token(self) -> str | None:
        """The bearer token, from the token file when one is configured."""
        if self.auth_token_file:
            with open(self.auth_token_file, encoding="utf-8") as f:
                return f.read().strip() or None
        return (self.auth_token or "").strip() or None


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# What init_device(config=...) may change: the shapes and sizes of the worker's own work. The
# model source (except the built-ins), paths, security, transport and server limits are the
# operator's (flags, environment), never a caller's. kv_cache_memory_bytes: the vLLM worker's.
RUNTIME_OVERRIDES = frozenset({
    "kv_dtype", "max_model_len", "seed", "device", "gpu_memory_utilization", "block_size", "max_num_seqs",
    "max_num_batched_tokens", "max_logprobs", "decode_ahead", "kv_cache_memory_bytes", "runner",
    # vLLM's speculative_config (ngram) drives the proposer through the worker class; a draft model is a path: not here
    "speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
})


def _is_builtin(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("builtin:")


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "str | None": str}


def _coerce(key: str, type_name: Any, value: Any) -> Any:
    want = _TYPES[str(type_name)]
    if value is None and "None" in str(type_name):
        return None
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is not bool and isinstance(value, bool) or not isinstance(value, want):
        from sidecar.wire.codec import KIND_NAMES, wire_type

        raise ConfigError(key, f"config key {key!r} must be {KIND_NAMES[want]}, got {wire_type(value)}")
    return value


def from_env(base: Config | None = None) -> Config:
    """Apply MLX_SIDECAR_* environment variables (MLX_SIDECAR_PORT=9000, ...)."""
    cfg = base or Config()
    overrides: dict[str, Any] = {}
    for f in fields(cfg):
        raw = os.environ.get(f"MLX_SIDECAR_{f.name.upper()}")
        if raw is None:
            continue
        want = _TYPES[str(f.type)]
        if want is bool:
            overrides[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                overrides[f.name] = want(raw)
            except ValueError as e:
                raise ConfigError(f.name, f"MLX_SIDECAR_{f.name.upper()}: {e}") from None
    return cfg.replace(**overrides) if overrides else cfg
