"""MLXWorker: the vLLM worker lifecycle and its state machine; compute is delegated to the runner.

Every method runs on the one MLX thread (the server guarantees it). Attributes the metrics read
(`state`, `healthy`, ...) are plain values replaced atomically, so a scrape never waits on a step.
"""

from __future__ import annotations

import cProfile
import enum
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from sidecar.config import Config, ConfigError
from sidecar.errors import ProtocolError, StateError, Unavailable
from sidecar.protocol import ModelRunnerOutput, check, get
from sidecar.runner import kv_groups
from sidecar.runner.kv_cache import DTYPES, KVPool, dtype_name
from sidecar.runner.batch_caches import probe_batched
from sidecar.runner.kv_spec import LayerSpec, derive, spec_wire
from sidecar.runner.model_runner import ModelRunner
from sidecar.runner.requests import RequestState, Row
from sidecar.limits import Limits, check_step_shape

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    CREATED = "created"
    DEVICE_READY = "device_ready"
    MODEL_LOADED = "model_loaded"
    CACHE_READY = "cache_ready"
    READY = "ready"
    SLEEPING = "sleeping"
    SHUT_DOWN = "shut_down"


S = State
_LOADED = {S.MODEL_LOADED, S.CACHE_READY, S.READY}
_CACHED = {S.CACHE_READY, S.READY}
# method -> (states it is allowed in, what must come first)
ALLOWED: dict[str, tuple[set[State], str]] = {
    "init_device": ({S.CREATED, S.DEVICE_READY, S.SHUT_DOWN}, "call shutdown first"),
    "load_model": ({S.DEVICE_READY}, "call init_device first (load_model runs once per init_device)"),
    "determine_available_memory": (_LOADED, "call load_model first"),
    "get_kv_cache_spec": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_kv_cache_groups": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_cache_block_size_bytes": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_model": (_LOADED, "call load_model first"),
    "vocab_size": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "initialize_cache": (_LOADED, "call load_model first"),
    "initialize_from_config": (_LOADED, "call load_model first"),
    "compile_or_warm_up_model": (_CACHED, "call initialize_cache first"),
    "execute_model": (_CACHED, "call initialize_cache first"),
    "take_draft_token_ids": (_CACHED, "call initialize_cache first"),
    "sleep": (_CACHED, "call initialize_cache first"),
    "wake_up": ({S.SLEEPING}, "call sleep first"),
    "check_health": (set(State), ""),
    "shutdown": (set(State), ""),
    "add_lora": (_LOADED, "call load_model first"),
    "remove_lora": (_LOADED, "call load_model first"),
    "pin_lora": (_LOADED, "call load_model first"),
    "list_loras": (_LOADED, "call load_model first"),
    "profile": (set(State), ""),
}


def lifecycle(fn: Callable) -> Callable:
    """Check the state machine before the call: out of order is a 409 naming what comes first."""

    @functools.wraps(fn)
    def wrapper(self: MLXWorker, *args: Any, **kwargs: Any) -> Any:
        self.require(fn.__name__)
        return fn(self, *args, **kwargs)

    return wrapper


def device_memory_bytes() -> int:
    """Device memory: MLX's device info on Metal/CUDA, the OS's physical memory on CPU."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
            if info.get(key):
                return int(info[key])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gpu_available() -> bool:
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


class MLXWorker:
    lazy_load = False  # scale-out (sidecar/distributed) loads lazily and materialises only its shard
    def __init__(self, vllm_config: Config | dict | None = None, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str = "", is_driver_worker: bool = False):
        if isinstance(vllm_config, dict):
            vllm_config = Config().replace(**vllm_config)
        self.config: Config = vllm_config or Config()
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method, self.is_driver_worker = distributed_init_method, is_driver_worker
        self.state = S.CREATED
        self.healthy = True
        self.last_health_check = 0.0
        self.device = "none"
        self.model: nn.Module | None = None
        self.model_config: dict = {}
        self.model_path: Path | None = None
        self.runner: ModelRunner | None = None
        self.weights_bytes = 0
        self.baseline_active_bytes = 0
        self.activation_peak_bytes = 0
        self._profiler: cProfile.Profile | None = None
        self._asleep: set[str] = set()
        self._awake_state = S.READY
        self._sleep_blocks = 0

    def __repr__(self) -> str:
        model = self.model_path.name if self.model_path else None
        blocks = self.runner.num_blocks if self.runner else 0
        return f"MLXWorker(state={self.state.value}, device={self.device}, model={model}, num_blocks={blocks})"

    # --- the state machine -------------------------------------------------------------------

    def require(self, method: str) -> None:
        states, hint = ALLOWED[method]
        if self.state not in states:
            if self.state == S.SLEEPING:
                raise Unavailable(f"{method}: the worker is sleeping; call wake_up first", retry_after=1)
            allowed = ", ".join(sorted(s.value for s in states))
            raise StateError(f"{method} is not allowed in state {self.state.value!r} (allowed: {allowed}); {hint}")

    # --- lifecycle ----------------------------------------------------------------------------

    @lifecycle
    def init_device(self, config: dict | None = None) -> None:
        if config:
            try:
                self.config = self.config.override(check(config, dict, "config"))
            except ConfigError as e:
                raise ProtocolError(str(e), field=f"config.{e.key}") from None
        want = self.config.device
        if want == "gpu" and not _gpu_available():
            raise ProtocolError("no GPU (Metal or CUDA) is available to MLX here", field="config.device")
        dev = mx.gpu if want != "cpu" and _gpu_available() else mx.cpu
        mx.set_default_device(dev)
        self.device = "gpu" if dev == mx.gpu else "cpu"
        info = mx.device_info() if dev == mx.gpu else {}
        log.info("init_device: %s %s (memory %d bytes)", self.device, info.get("device_name", ""), device_memory_bytes())
        self.baseline_active_bytes = mx.get_active_memory()
        self.state = S.DEVICE_READY

    @lifecycle
    def load_model(self) -> None:
        from mlx_lm.utils import load_model

        from sidecar.models import ModelNotFound, resolve_model

        try:  # what fails here is the model directory the operator configured: 4xx, and no paths
            path = resolve_model(self.config.model, self.config.home)
            model, config = load_model(path, lazy=self.lazy_load)
            self.model, self.model_config, self.model_path = model, config, path
            vocab, eos = self._vocab_size(), self._eos_ids()
        except (Exception, SystemExit) as e:  # noqa: BLE001 (mlx-lm's olmo module exits without ai2-olmo)
            self.model, self.model_config, self.model_path = None, {}, None
            why = "not found or not an mlx-lm model directory" if isinstance(e, ModelNotFound) else type(e).__name__
            raise ProtocolError(f"the configured model cannot be loaded ({why})", field="config.model") from None
        kv_dtype = None if self.config.kv_dtype == "auto" else self.config.kv_dtype
        try:
            caches = derive(model, self.config.block_size, kv_dtype)  # 400 naming an unsupported layer kind
        except BaseException:
            self.model, self.model_config, self.model_path = None, {}, None
            raise
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        cap = self.config.max_model_len or min(int(config.get("max_position_embeddings") or 4096), 32768)
        self.runner = ModelRunner(
            model, caches.specs, vocab_size=vocab, eos_token_ids=eos,
            max_model_len=cap, max_logprobs=self.config.max_logprobs, seed=self.config.seed,
            lora_dir=self.config.lora_dir, max_loras=self.config.max_loras, decode_ahead=self.config.decode_ahead,
            caches=caches,
        )
        try:
            probe_batched(self.runner)
        except BaseException:
            self.runner = self.model = None
            self.model_config = {}
            raise
        from sidecar.runner.proposers import proposer_for

        if caches.has_state and self.config.spec_method != "none":
            self.runner = self.model = None
            self.model_config = {}
            raise ProtocolError("speculative decoding is not offered for models with recurrent state",
                                field="config.speculative_method")
        self.runner.proposer = proposer_for(self.config, vocab_size=self._vocab_size(), max_model_len=cap,
                                            layer_specs=self._layer_specs)
        log.info("load_model: %s (%d weight bytes)", path, self.weights_bytes)
        self.state = S.MODEL_LOADED

    def _model_dtype(self) -> mx.Dtype:
        for _, v in tree_flatten(self.model.parameters()):  # type: ignore[union-attr]
            if v.dtype in DTYPES.values():
                return v.dtype
        return mx.float16

    def _vocab_size(self) -> int:
        if "vocab_size" in self.model_config:
            return int(self.model_config["vocab_size"])
        return int(self.model_config["text_config"]["vocab_size"])

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        sources = [self.model_config]
        gen = self.model_path / "generation_config.json"  # type: ignore[operator]
        if gen.exists():
            sources.append(json.loads(gen.read_text()))
        for src in sources:
            v = src.get("eos_token_id")
            ids += v if isinstance(v, list) else [] if v is None else [v]
        return sorted(set(ids))

    def _layer_specs(self, model_config: dict | None = None, model: nn.Module | None = None) -> list[LayerSpec]:
        """A draft model's layer specs, measured from it like the model's own (plain cache lists only)."""
        kv_dtype = None if self.config.kv_dtype == "auto" else self.config.kv_dtype
        caches = derive(model or self.model, self.config.block_size, kv_dtype)
        if (caches.has_state or caches.scalar_offsets or caches.mask_5d
                or any(not isinstance(s, int) for s in caches.structure)):
            raise ProtocolError("a draft model needs plain attention layers (no recurrent state, CacheList, "
                                "grouped 5-D scores or one-row-at-a-time attention)", field="config.draft_model")
        return caches.specs

    @lifecycle
    def determine_available_memory(self) -> int:
        assert self.runner is not None
        mx.eval(self.model.parameters())  # type: ignore[union-attr]
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        self._profile_run()
        self.activation_peak_bytes = max(0, mx.get_peak_memory() - before)
        mx.clear_cache()
        total = int(device_memory_bytes() * self.config.gpu_memory_utilization)
        held = self.runner.pool.nbytes if self.runner.pool else 0  # an existing pool is reusable
        free = total - self.weights_bytes - self.activation_peak_bytes - (mx.get_active_memory() - before) + held
        draft = getattr(self.runner.proposer, "runner", None)
        if draft is not None:  # the draft model's weights, and a draft block for every block of ours
            free -= sum(v.nbytes for _, v in tree_flatten(draft.model.parameters()))
            ours, theirs = self.get_cache_block_size_bytes(), sum(s.page_size_bytes for s in draft.specs)
            free = free * ours // (ours + theirs)
        log.info("determine_available_memory: %d bytes (weights %d, activation peak %d)",
                 free, self.weights_bytes, self.activation_peak_bytes)
        return max(0, free)

    def _profile_run(self) -> float:
        """Forwards at the configured limits on a scratch pool: a full-budget prefill and a full decode batch."""
        runner = self.runner
        assert runner is not None
        cfg = self.config
        seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
        prefill = max(1, min(cfg.max_num_batched_tokens, runner.max_model_len))
        bs = cfg.block_size
        blocks = -(-prefill // bs) + seqs
        pool, saved = runner.pool, runner.requests
        t0 = time.perf_counter()
        try:
            runner.pool, runner.requests = KVPool(runner.specs, blocks), {}
            from sidecar.runner.sampler import SamplingParams

            greedy = SamplingParams(temperature=0.0)
            big = RequestState("profile-prefill", [0] * prefill, greedy, list(range(-(-prefill // bs))))
            runner._run([Row(big, 0, big.prompt_token_ids, big.block_ids, True)])
            rows = []
            for i in range(seqs):
                s = RequestState(f"profile-{i}", [0], greedy, [blocks - 1 - i])
                rows.append(Row(s, 0, [0], s.block_ids, True))
            runner._run(rows)
        finally:
            runner.pool, runner.requests = pool, saved
        return time.perf_counter() - t0

    @lifecycle
    def get_kv_cache_spec(self) -> dict[str, dict]:
        assert self.runner is not None
        return spec_wire(self.runner.specs)

    @lifecycle
    def get_kv_cache_groups(self) -> list[dict]:
        """The KV cache groups requests send block lists for, in order (vLLM's KVCacheGroupSpec)."""
        assert self.runner is not None
        return kv_groups.groups_view(self.runner)

    @lifecycle
    def get_cache_block_size_bytes(self) -> int:
        assert self.runner is not None
        return sum(s.page_size_bytes for s in self.runner.specs)

    @lifecycle
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        assert self.runner is not None
        check(num_gpu_blocks, int, "num_gpu_blocks")
        check(num_cpu_blocks, int, "num_cpu_blocks")
        if num_gpu_blocks < 1:
            raise ProtocolError("num_gpu_blocks must be >= 1", field="num_gpu_blocks")
        need = num_gpu_blocks * self.get_cache_block_size_bytes()
        limit = device_memory_bytes()
        if need > limit:
            raise ProtocolError(f"{num_gpu_blocks} blocks need {need} bytes, the device has {limit}", field="num_gpu_blocks")
        self.runner.allocate(num_gpu_blocks)
        log.info("initialize_cache: %d blocks of %d tokens (%d bytes)", num_gpu_blocks, self.config.block_size, need)
        self.state = S.CACHE_READY

    @lifecycle
    def initialize_from_config(self, kv_cache_config: dict) -> None:
        """vLLM's KVCacheConfig: {num_blocks, kv_cache_tensors, kv_cache_groups: [{layer_names, kv_cache_spec}]}."""
        path = "kv_cache_config"
        check(kv_cache_config, dict, path)
        num_blocks = get(kv_cache_config, "num_blocks", int, path)
        groups = get(kv_cache_config, "kv_cache_groups", list, path, default=[])
        ours = self.get_kv_cache_spec()
        order = kv_groups.scheduler_groups(self.runner, groups, path)  # validated before anything changes
        named: set[str] = set()
        for i, g in enumerate(groups):
            gp = f"{path}.kv_cache_groups[{i}]"
            check(g, dict, gp)
            names = get(g, "layer_names", list, gp)
            for j, name in enumerate(names):
                if name not in ours:
                    raise ProtocolError(f"unknown layer {name!r}", field=f"{gp}.layer_names[{j}]")
            named.update(names)
            spec = get(g, "kv_cache_spec", dict, gp, default={})
            bs = spec.get("block_size", self.config.block_size)
            # A recurrent-state group's block size means nothing here (one state slot per block id);
            # vLLM's hybrid allocator sizes it to match page sizes.
            state_group = bool(names) and ours[names[0]]["type"] == "mamba"
            if bs != self.config.block_size and not state_group:
                raise ProtocolError(f"block_size {bs} differs from the worker's {self.config.block_size}",
                                    field=f"{gp}.kv_cache_spec.block_size")
        if groups and named != set(ours):
            missing = sorted(set(ours) - named)[0]
            raise ProtocolError(f"layer {missing!r} is in no KV cache group", field=f"{path}.kv_cache_groups")
        self.initialize_cache(num_blocks, 0)
        self.runner.set_groups(order)

    @lifecycle
    def compile_or_warm_up_model(self) -> float:
        seconds = self._profile_run()
        mx.clear_cache()
        self.state = S.READY
        return seconds

    @lifecycle
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        assert self.runner is not None
        # Bounds by shape first: a body that breaks one is rejected before anything walks it.
        limits = Limits.of(self.config, self.runner.max_model_len, self.runner.vocab_size)
        check_step_shape(scheduler_output, self.runner.requests, limits)
        return self.runner.execute_model(self.runner.decode(scheduler_output))

    @lifecycle
    def take_draft_token_ids(self) -> dict | None:
        """Drafts the proposer made in the last step (vLLM's DraftTokenIds), taken once; null when
        speculation is off or no request got drafts."""
        proposer = self.runner.proposer if self.runner is not None else None
        return proposer.take() if proposer is not None else None

    @lifecycle
    def check_health(self) -> None:
        # A small real computation on the device, checked against its known answer.
        a = mx.array([[1.0, 2.0], [3.0, 4.0]])
        got = (a @ mx.array([[5.0], [6.0]])).reshape(-1).tolist()
        self.healthy = got == [17.0, 39.0]
        self.last_health_check = time.time()
        if not self.healthy:
            raise Unavailable(f"device health check failed: 2x2 matmul gave {got}", retry_after=5)

    @lifecycle
    def get_model(self) -> dict:
        c = self.model_config.get("text_config", self.model_config)
        params = sum(v.size for _, v in tree_flatten(self.model.parameters()))  # type: ignore[union-attr]
        return {
            "type": c.get("model_type"), "num_layers": len(self.model.layers),  # type: ignore[union-attr]
            "hidden_size": c.get("hidden_size"), "num_attention_heads": c.get("num_attention_heads"),
            "num_kv_heads": next((s.num_kv_heads for s in self.runner.specs if s.kind != "state"), 0) if self.runner else None,
            "vocab_size": self._vocab_size(), "params": params, "weights_bytes": self.weights_bytes,
            "dtype": dtype_name(self._model_dtype()), "quantization": self.model_config.get("quantization"),
            "max_model_len": self.runner.max_model_len if self.runner else None,
            "eos_token_ids": self._eos_ids(), "path": str(self.model_path), "name": self.config.model,
        }

    @lifecycle
    def vocab_size(self) -> int:
        return self._vocab_size()

    @lifecycle
    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.free()
        self.runner = self.model = None
        self.model_config = {}
        self.weights_bytes = 0
        mx.clear_cache()
        log.info("shutdown: active memory %d bytes", mx.get_active_memory())
        self.state = S.SHUT_DOWN

    # --- sleep mode ---------------------------------------------------------------------------

    @lifecycle
    def sleep(self, level: int = 1) -> None:
        """Level 1 discards the KV cache (contents and request state); level 2 also frees the
        weights, reloaded from disk on wake_up. (On unified memory there is no host to offload to.)"""
        if check(level, int, "level") not in (1, 2):
            raise ProtocolError(f"level must be 1 or 2, got {level}", field="level")
        assert self.runner is not None
        self._awake_state, self._sleep_blocks = self.state, self.runner.num_blocks
        self.runner.free()
        self._asleep = {"kv_cache"}
        if level == 2:
            self.runner.drop_model()
            self.model = None
            self.weights_bytes = 0
            self._asleep.add("weights")
        mx.clear_cache()
        self.state = S.SLEEPING
        log.info("sleep(level=%d): active memory %d bytes", level, mx.get_active_memory())

    @lifecycle
    def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = {"weights", "kv_cache"} if tags is None else set(check(tags, list, "tags"))
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ProtocolError(f"unknown tag {sorted(unknown)[0]!r} (tags: weights, kv_cache)", field="tags")
        assert self.runner is not None
        if "weights" in wanted & self._asleep:
            from mlx_lm.utils import load_model

            model, _ = load_model(self.model_path, lazy=self.lazy_load)  # type: ignore[arg-type]
            self.model = model
            self.runner.set_model(model)
            self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            self._asleep.discard("weights")
        if "kv_cache" in wanted & self._asleep:
            self.runner.allocate(self._sleep_blocks)
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self.state = self._awake_state

    # --- profiling ----------------------------------------------------------------------------

    @lifecycle
    def profile(self, is_start: bool = True) -> str | None:
        """cProfile of the MLX thread (every worker call runs there), plus a Metal GPU capture when
        available; stop writes `<home>/profiles/worker-<time>.prof` and returns its path."""
        check(is_start, bool, "is_start")
        if is_start:
            if self._profiler is not None:
                raise StateError("a profile is already running; call profile(is_start=False) first")
            self._profiler = cProfile.Profile()
            self._profiler.enable()
            return None
        if self._profiler is None:
            raise StateError("no profile is running; call profile(is_start=True) first")
        self._profiler.disable()
        from sidecar.models import cache_home

        out = cache_home(self.config.home) / "profiles" / f"worker-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.prof"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.dump_stats(str(out))
        self._profiler = None
        log.info("profile written to %s", out)
        return str(out)

    # --- LoRA adapters (mlx-lm format, from under --lora-dir) ------------------------------------

    @lifecycle
    def add_lora(self, lora_request: dict) -> bool:
        """Load an adapter: {lora_int_id, lora_name, lora_path (relative to --lora-dir)}. False
        when the id is already loaded or every slot holds a pinned or in-use adapter."""
        assert self.runner is not None
        check(lora_request, dict, "lora_request")
        lora_id = get(lora_request, "lora_int_id", int, "lora_request")
        if lora_id < 1:
            raise ProtocolError("lora_int_id must be >= 1", field="lora_request.lora_int_id")
        name = get(lora_request, "lora_name", str, "lora_request", default=str(lora_id))
        path = get(lora_request, "lora_path", str, "lora_request")
        return self.runner.lora.add(lora_id, name, path, self.runner.loras_in_use())

    @lifecycle
    def remove_lora(self, lora_id: int) -> bool:
        """False when unknown or still used by a live request."""
        assert self.runner is not None
        return self.runner.lora.remove(check(lora_id, int, "lora_id"), self.runner.loras_in_use())

    @lifecycle
    def pin_lora(self, lora_id: int) -> bool:
        assert self.runner is not None
        return self.runner.lora.pin(check(lora_id, int, "lora_id"))

    @lifecycle
    def list_loras(self) -> list[int]:
        assert self.runner is not None
        return sorted(self.runner.lora.adapters)
