"""MLXWorker: the vLLM worker lifecycle; compute is delegated to the runner, the state machine
(sidecar/worker/lifecycle.py), memory accounting (sidecar/worker/memory.py), sleep mode, profiling and model
facts to small helpers.

Every method runs on the one MLX thread (the server guarantees it). Attributes the metrics read
(`state`, `healthy`, ...) are plain values replaced atomically, so a scrape never waits on a step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from sidecar.config import Config, ConfigError
from sidecar.errors import ProtocolError, Unavailable
from sidecar.worker.lifecycle import ALLOWED, INIT_STATES, S, State, StateMachine, lifecycle
from sidecar.wire.limits import Limits, check_step_shape
from sidecar.wire.lora_request import lora_request_args
from sidecar.worker.memory import check_pool_fits, device_memory_bytes, kv_bytes_free, memory_budget_bytes, profile_run
from sidecar.worker.model_info import describe, eos_ids, vocab_size, weights_bytes
from sidecar.worker.profiling import Profiler
from sidecar.wire.protocol import ModelRunnerOutput, check, get
from sidecar.worker import kv_groups
from sidecar.kv.batch_caches import probe_batched
from sidecar.kv.probe import derive
from sidecar.kv.spec import LayerSpec, spec_wire
from sidecar.engine.model_runner import ModelRunner
from sidecar.worker.sleep import SleepMode

__all__ = ["ALLOWED", "MLXWorker", "State", "device_memory_bytes", "lifecycle", "memory_budget_bytes"]

log = logging.getLogger(__name__)


def _gpu_available() -> bool:
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


class MLXWorker(StateMachine):
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
        self._warm_shape: tuple | None = None  # the shape profile_run last ran at (determine_available_memory)
        self._profiler = Profiler()
        self._sleep = SleepMode()

    def __repr__(self) -> str:
        model = self.model_path.name if self.model_path else None
        blocks = self.runner.num_blocks if self.runner else 0
        return f"MLXWorker(state={self.state.value}, device={self.device}, model={model}, num_blocks={blocks})"

    def _shape(self) -> tuple:
        """What profile_run computes: the same tuple means the same forwards on the same model."""
        c = self.config
        return (id(self.runner), c.max_num_batched_tokens, c.max_num_seqs, c.block_size, c.max_model_len, c.kv_dtype)

    def _pool_bytes(self) -> int:
        """Bytes of the pools a new allocation replaces (ours and a draft model's): reusable."""
        runner = self.runner
        if runner is None:
            return 0
        draft = getattr(runner.proposer, "runner", None)
        return sum(r.pool.nbytes for r in (runner, draft) if r is not None and r.pool is not None)

    # --- lifecycle ----------------------------------------------------------------------------

    @lifecycle
    def init_device(self, config: dict | None = None, reset: bool = False) -> None:
        """v2 `reset=true`: allowed in any state; past `device_ready` the model, the cache and all
        request state are dropped first (as `shutdown`), so a restarted scheduler can re-initialise
        a running worker. Without it, as v1: only in created, device_ready and shut_down."""
        check(reset, bool, "reset")
        if not reset:
            self.require("init_device", INIT_STATES, "call shutdown first, or init_device with reset=true")
        if config:
            try:
                new_config = self.config.override(check(config, dict, "config"))
            except ConfigError as e:
                raise ProtocolError(str(e), field=f"config.{e.key}") from None
        else:
            new_config = self.config
        if self.state not in (S.CREATED, S.DEVICE_READY, S.SHUT_DOWN):
            log.info("init_device in state %s: dropping the model and cache first", self.state.value)
            self.shutdown()
        self.config = new_config
        self._warm_shape = None
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
        from sidecar.engine import pooling
        from sidecar.models import ModelNotFound, resolve_model
        from sidecar.models.importable import check_importable
        from sidecar.models.vision import is_served, load_vision, unserved
        from sidecar.kv.spec import UnsupportedModel

        path = None
        try:  # what fails here is the model directory the operator configured: 4xx, and no paths
            path = resolve_model(self.config.model, self.config.home)
            check_importable(path)  # 400 (field model) naming a package mlx-lm's module needs
            vision = is_served(path)  # images through mlx-vlm's model code (models/vision.py)
            model, config = load_vision(path) if vision else pooling.load(path, lazy=self.lazy_load)
            self.model, self.model_config, self.model_path = model, config, path
            vocab, eos = vocab_size(config), eos_ids(config, path)
        except UnsupportedModel:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 (mlx-lm's olmo module exits without ai2-olmo)
            self.model, self.model_config, self.model_path = None, {}, None
            why = "not found or not an mlx-lm model directory" if isinstance(e, ModelNotFound) else type(e).__name__
            refused = unserved(path) if path is not None else None
            if refused:  # a vision-language checkpoint: name its family rather than mlx-lm's error
                why = f"{refused}; mlx-lm cannot load its text half: {why}"
            raise ProtocolError(f"the configured model cannot be loaded ({why})", field="config.model") from None
        kv_dtype = None if self.config.kv_dtype == "auto" else self.config.kv_dtype
        try:
            caches = derive(model, self.config.block_size, kv_dtype)  # 400 naming an unsupported layer kind
            pooling_offered = pooling.pooling_model(model, config, path, self.config.runner)
        except BaseException:
            self.model, self.model_config, self.model_path = None, {}, None
            raise
        self.weights_bytes = weights_bytes(model)
        cap = self.config.max_model_len or min(int(config.get("max_position_embeddings") or 4096), 32768)
        self.runner = ModelRunner(
            model, caches.specs, vocab_size=vocab, eos_token_ids=eos,
            max_model_len=cap, max_logprobs=self.config.max_logprobs, seed=self.config.seed,
            lora_dir=self.config.lora_dir, max_loras=self.config.max_loras, decode_ahead=self.config.decode_ahead,
            caches=caches,
        )
        self.runner.pooling = pooling_offered
        if vision:
            from sidecar.engine.multimodal import Multimodal

            self.runner.mm = Multimodal(model, self.config.max_encoder_cache_bytes)
        try:
            probe_batched(self.runner)
        except BaseException:
            self.runner = self.model = None
            self.model_config = {}
            raise
        from sidecar.engine.proposers import proposer_for

        if caches.has_state and self.config.spec_method != "none":
            self.runner = self.model = None
            self.model_config = {}
            raise ProtocolError("speculative decoding is not offered for models with recurrent state",
                                field="config.speculative_method")
        self.runner.proposer = proposer_for(self.config, vocab_size=vocab, max_model_len=cap,
                                            layer_specs=self._layer_specs)
        from sidecar.engine.kv_tier import open_tier

        self.runner.kv_tier = open_tier(self.config.kv_store_dir, self.config.kv_store_max_gb, self.config.model,
                                        path, caches.specs)
        log.info("load_model: %s (%d weight bytes)", path, self.weights_bytes)
        if (refused := unserved(path)) is not None:
            log.warning("load_model: serving the text half only: %s", refused)
        self.state = S.MODEL_LOADED

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
    def determine_available_memory(self, kv_cache_memory_bytes: int | None = None,
                                   gpu_memory_utilization: float | None = None) -> int:
        """Bytes for the KV pool. v2: vLLM's `kv_cache_memory_bytes` is taken as is (checked
        against the memory budget), `gpu_memory_utilization` overrides the configured fraction."""
        assert self.runner is not None
        if kv_cache_memory_bytes is not None:
            check(kv_cache_memory_bytes, int, "kv_cache_memory_bytes")
            budget = memory_budget_bytes()
            if not 0 < kv_cache_memory_bytes <= budget:
                raise ProtocolError(f"must be in (0, {budget}] bytes (the memory this process can have)",
                                    field="kv_cache_memory_bytes")
            return kv_cache_memory_bytes
        fraction = self.config.gpu_memory_utilization
        if gpu_memory_utilization is not None:
            fraction = check(gpu_memory_utilization, float, "gpu_memory_utilization")
            if not 0 < fraction <= 1:
                raise ProtocolError("must be in (0, 1]", field="gpu_memory_utilization")
        mx.eval(self.model.parameters())  # type: ignore[union-attr]
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        profile_run(self.runner, self.config)
        self._warm_shape = self._shape()
        self.activation_peak_bytes = max(0, mx.get_peak_memory() - before)
        mx.clear_cache()
        free = kv_bytes_free(fraction, self._pool_bytes(), self.activation_peak_bytes)
        draft = getattr(self.runner.proposer, "runner", None)
        if draft is not None:  # a draft block for every block of ours (its weights are held: counted)
            ours, theirs = self.get_cache_block_size_bytes(), sum(s.page_size_bytes for s in draft.specs)
            free = free * ours // (ours + theirs)
        log.info("determine_available_memory: %d bytes (weights %d, activation peak %d)",
                 free, self.weights_bytes, self.activation_peak_bytes)
        return max(0, free)

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
        draft = getattr(self.runner.proposer, "runner", None)  # it allocates a draft block for each of ours
        per_block = self.get_cache_block_size_bytes() + (sum(s.page_size_bytes for s in draft.specs) if draft else 0)
        need = check_pool_fits(num_gpu_blocks, per_block, self._pool_bytes(), self.activation_peak_bytes)
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
        order = kv_groups.scheduler_groups(self.runner, groups, path, self.config.block_size)  # before any change
        try:
            self.initialize_cache(num_blocks, 0)
        except ProtocolError as e:  # its checks name its own argument; here that is num_blocks
            if e.field == "num_gpu_blocks":
                e.field = f"{path}.num_blocks"
            raise
        self.runner.set_groups(order)

    @lifecycle
    def compile_or_warm_up_model(self, compilation_times: bool = False) -> float | dict:
        """Seconds spent; v2 `compilation_times=True`: vLLM's CompilationTimes shape
        `{"language_model": s, "encoder": 0.0}`."""
        check(compilation_times, bool, "compilation_times")
        # The memory profile already ran these forwards on this model: a second run warms nothing
        # more (MLX compiles a kernel on its first use) and, on a CPU backend, costs minutes.
        seconds = 0.0 if self._warm_shape == self._shape() else profile_run(self.runner, self.config)
        self._warm_shape = None  # (once: a warm-up asked for again runs)
        mx.clear_cache()
        self.state = S.READY
        return {"language_model": seconds, "encoder": 0.0} if compilation_times else seconds

    @lifecycle
    def execute_model(self, scheduler_output: Any, defer_sampling: bool = False) -> ModelRunnerOutput | None:
        """v2 `defer_sampling=True`: run the forward, return null; `sample_tokens` samples it."""
        assert self.runner is not None
        check(defer_sampling, bool, "defer_sampling")
        # Bounds by shape first: a body that breaks one is rejected before anything walks it.
        limits = Limits.of(self.config, self.runner.max_model_len, self.runner.vocab_size)
        check_step_shape(scheduler_output, self.runner.requests, limits)
        return self.runner.execute_model(self.runner.decode(scheduler_output), defer_sampling)

    @lifecycle
    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        """v2: sample the deferred step; `grammar_output` is vLLM's GrammarOutput or null."""
        assert self.runner is not None
        return self.runner.sample_tokens(grammar_output)

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
        return describe(self)

    @lifecycle
    def vocab_size(self) -> int:
        return vocab_size(self.model_config)

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

    # --- sleep mode, profiling, LoRA adapters (mlx-lm format, from under --lora-dir) -------------

    @lifecycle
    def sleep(self, level: int = 1) -> None:
        """Level 1 discards the KV cache (contents and request state); level 2 also frees the
        weights, reloaded from disk on wake_up."""
        self._sleep.sleep(self, level)

    @lifecycle
    def wake_up(self, tags: list[str] | None = None) -> None:
        self._sleep.wake_up(self, tags)

    @lifecycle
    def profile(self, is_start: bool = True) -> str | None:
        """cProfile of the MLX thread; stop writes `<home>/profiles/worker-<time>.prof` and returns its path."""
        if check(is_start, bool, "is_start"):
            self._profiler.start()
            return None
        return self._profiler.stop(self.config.home)

    @lifecycle
    def add_lora(self, lora_request: dict) -> bool:
        """Load an adapter: {lora_int_id, lora_name, lora_path (relative to --lora-dir)}. False
        when the id is already loaded or every slot holds a pinned or in-use adapter."""
        assert self.runner is not None
        lora_id, name, path = lora_request_args(lora_request)
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
    def kv_store_lookup(self, block_hashes: list, lora_request: dict | None = None) -> int:
        """How many leading blocks of these hashes (the scheduler's chained block hashes) the disk
        KV tier holds for this model and adapter; 400 (field `kv_store`) without --kv-store-dir."""
        assert self.runner is not None
        if self.runner.kv_tier is None:
            raise ProtocolError("this worker has no KV store (serve --kv-store-dir)", field="kv_store")
        return self.runner.kv_tier.lookup(block_hashes, lora_request)

    @lifecycle
    def list_loras(self) -> list[int]:
        assert self.runner is not None
        return sorted(self.runner.lora.adapters)
