"""The worker class an unmodified vLLM loads with `--worker-cls sidecar.vllm.worker.MLXSidecarWorker`.

Every call is forwarded over msgpack RPC to an mlx-sidecar (RemoteWorker, one persistent
connection); the model runs there, on MLX. This process holds no weights and imports no MLX.
Where the sidecar is (the normal case: another host, e.g. a Mac) comes from vLLM's
`--additional-config '{"mlx_sidecar": {"url": ..., "auth_token": ...}}'` or the environment
(`MLX_SIDECAR_URL`, `MLX_SIDECAR_AUTH_TOKEN`); default `http://127.0.0.1:8000`.

Speculative decoding: vLLM's `speculative_config` (method "ngram", or "draft_model" with the
sidecar's own --draft-model) configures the sidecar's proposer through init_device; the sidecar
proposes after each step, vLLM's EngineCore takes the drafts with `take_draft_token_ids` and its
scheduler sends them back to be verified there.

A step without structured outputs is one round trip (`execute_model` returns the output, which
vLLM's EngineCore accepts as is); with them, `execute_model(defer_sampling=True)` starts the
forward and returns None, vLLM computes the grammar bitmask meanwhile and `sample_tokens` sends it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.vllm import convert, dp
from sidecar.vllm.async_steps import AsyncSteps
from sidecar.vllm.progress import heartbeat, warm_up_shape
from sidecar.vllm.convert import Unsupported
from sidecar.vllm.platform import MLXSidecarPlatform
from sidecar.vllm.recovery import Recovering, SidecarLost

log = logging.getLogger("vllm.mlx_sidecar")  # vLLM shows its own loggers' output only

DEFAULT_URL = "http://127.0.0.1:8000"
KNOWN_KEYS = ("url", "urls", "auth_token", "auth_token_file", "timeout", "recover_timeout")


def sidecar_settings(additional_config: Any, dp_rank: int = 0) -> dict:
    """url, auth_token and timeout: --additional-config's "mlx_sidecar" map first, then the environment.
    Data parallel: rank `dp_rank` takes its own sidecar from "urls" / MLX_SIDECAR_URLS (sidecar/vllm/dp.py)."""
    cfg = additional_config.get("mlx_sidecar", {}) if isinstance(additional_config, dict) else {}
    if not isinstance(cfg, dict):
        raise Unsupported('--additional-config "mlx_sidecar" must be a map, e.g. {"url": "http://mac:8000"}')
    unknown = set(cfg) - set(KNOWN_KEYS)
    if unknown:
        raise Unsupported(f'unknown --additional-config mlx_sidecar key {sorted(unknown)[0]!r} '
                          f'(known: {", ".join(KNOWN_KEYS)})')
    token = None
    for value, from_file in ((cfg.get("auth_token"), False), (cfg.get("auth_token_file"), True),
                             (os.environ.get("MLX_SIDECAR_AUTH_TOKEN"), False),
                             (os.environ.get("MLX_SIDECAR_AUTH_TOKEN_FILE"), True)):
        if value:
            if from_file:
                with open(value) as f:
                    value = f.read().strip()
            token = value
            break
    return {"url": dp.rank_url(cfg, dp_rank, DEFAULT_URL), "token": token or None,
            "timeout": float(cfg.get("timeout") or os.environ.get("MLX_SIDECAR_TIMEOUT") or 600),
            "recover_timeout": float(cfg.get("recover_timeout", os.environ.get("MLX_SIDECAR_RECOVER_TIMEOUT", 120)))}


class MLXSidecarWorker(WorkerBase):
    def __init__(self, vllm_config: Any, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs: Any):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        if vllm_config.parallel_config.world_size != 1:
            raise Unsupported("the MLX sidecar is one worker: use tensor/pipeline parallel size 1 "
                              "(scale-out happens inside the sidecar, with mx.distributed)")
        dp.check_parallel(vllm_config.parallel_config)
        self.dp_rank = dp.dp_rank(vllm_config.parallel_config)
        s = sidecar_settings(vllm_config.additional_config, self.dp_rank)
        # pin_instance: a sidecar that restarted under us answers 409 instead of acting on a fresh state.
        self.remote = RemoteWorker(s["url"], token=s["token"], timeout=s["timeout"], pin_instance=True)
        # Every call goes through it: a restarted sidecar is waited for and rebuilt (sidecar/vllm/recovery.py).
        cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
        where = f"MLX sidecar at {s['url']}" + (f" (data parallel rank {self.dp_rank})" if self.dp_rank else "")
        self.sidecar = Recovering(self.remote, where=where, recover_timeout=s["recover_timeout"],
                                  block_size=cc.block_size, budget=sc.max_num_batched_tokens,
                                  max_seqs=sc.max_num_seqs, prefix_cache=bool(cc.enable_prefix_caching))
        self._loras: set[int] = set()
        self._deferred = False
        self._step_id = 1  # exactly-once steps: a step whose reply was lost is resent with its number
        # vLLM's --async-scheduling: steps sent ahead of their replies (sidecar/vllm/async_steps.py)
        self._async = (AsyncSteps(self.remote, recovering=self.sidecar)
                       if vllm_config.scheduler_config.async_scheduling else None)
        self._pending: Any = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.sidecar.call(method, **kwargs)

    # --- start-up -------------------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        mc, cc, sc = self.model_config, self.cache_config, self.scheduler_config
        convert.cache_dtype(cc.cache_dtype)
        config = {"block_size": cc.block_size, "max_model_len": mc.max_model_len, "max_num_seqs": sc.max_num_seqs,
                  "max_num_batched_tokens": sc.max_num_batched_tokens, "max_logprobs": mc.max_logprobs}
        if mc.seed is not None:
            config["seed"] = mc.seed
        config.update(convert.speculative_config(self.vllm_config.speculative_config))
        if mc.runner_type == "pooling":  # any decoder may embed (--convert embed), as in vLLM
            convert.pooler_config(mc.pooler_config, bool(cc.enable_prefix_caching))
            config["runner"] = "pooling"

        try:
            self._call("init_device", config=config, reset=True)  # from any state: a restarted vLLM starts over
        except RemoteError as e:
            if e.field == "config.draft_model":
                raise Unsupported('speculative_config method "draft_model" runs the sidecar\'s own draft model, '
                                  "and this sidecar has none: start it with --draft-model (builtin:<name> or an "
                                  "mlx-lm directory with the model's tokenizer)") from e
            raise
        self._loras.clear()
        if self._async is not None:
            self._async.reset()
        log.info("MLX sidecar at %s initialised (%s%s)", self.remote.url, config,
                 ", async scheduling" if self._async is not None else "")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        self._call("load_model")
        theirs, ours = self._call("vocab_size"), self.model_config.get_vocab_size()
        if theirs != ours:
            raise Unsupported(f"the sidecar's model has vocab_size {theirs}, vLLM's model directory says {ours}: "
                              "point vLLM at the sidecar model's directory (mlx-sidecar model-dir)")

    def get_kv_cache_spec(self) -> dict:
        return convert.kv_cache_spec(self._call("get_kv_cache_spec"))

    def determine_available_memory(self) -> int:
        cc = self.cache_config
        if cc.kv_cache_memory_bytes is not None:
            return self._call("determine_available_memory", kv_cache_memory_bytes=int(cc.kv_cache_memory_bytes))
        with heartbeat("measuring activation memory with " + warm_up_shape(self.scheduler_config)):
            free = self._call("determine_available_memory", gpu_memory_utilization=float(cc.gpu_memory_utilization))
        if not isinstance(current_platform, MLXSidecarPlatform):
            return free
        # The plugin's default pool: what max_num_seqs requests of max_model_len tokens can hold,
        # not most of the host's free memory (which takes minutes to fill on a CPU backend).
        reach = self._call("get_cache_block_size_bytes") * (
            self.scheduler_config.max_num_seqs * -(-self.model_config.max_model_len // cc.block_size) + 1)
        if reach < free:
            log.info("MLX sidecar: KV pool of %d bytes (max_num_seqs x max_model_len) of the %d the sidecar offers; "
                     "--kv-cache-memory-bytes sets another", reach, free)
        return min(free, reach)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self._call("initialize_from_config", kv_cache_config=convert.kv_cache_config(kv_cache_config))

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._call("initialize_cache", num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        with heartbeat("warming up with " + warm_up_shape(self.scheduler_config)):
            return CompilationTimes(**self._call("compile_or_warm_up_model", compilation_times=True))

    def get_supported_tasks(self) -> tuple[str, ...]:
        if self.model_config.runner_type != "pooling":
            return ("generate",)
        labels = (self._call("get_model").get("pooling") or {}).get("num_labels", 0)
        return ("classify", "token_classify") if labels else ("embed", "token_embed")

    def reset_mm_cache(self) -> None:
        pass  # no multi-modal inputs reach the sidecar: nothing is cached

    def reset_encoder_cache(self) -> None:
        pass  # no encoder runs in the sidecar: nothing is cached

    def update_max_model_len(self, max_model_len: int) -> None:
        # vLLM shrank the length to fit the KV budget; the sidecar's bound (checked per step) is looser.
        self.model_config.max_model_len = max_model_len

    # --- steps --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any) -> Any:
        self._load_loras(scheduler_output)
        wire = convert.scheduler_output(scheduler_output, self.model_config.pooler_config)
        meta = getattr(scheduler_output, "kv_connector_metadata", None)
        if hasattr(meta, "step_fields"):  # the disk KV tier's loads and saves (sidecar.vllm.kv_connector)
            wire.update(meta.step_fields())
        if self._async is not None:
            # Requests the sidecar must see as new after a recovery go one step at a time (recovery.py).
            if not scheduler_output.has_structured_output_requests and not self.sidecar.fresh:
                out = self._async.execute(wire, self._step_id, self._async_output(wire))
                self._step_id += 1
                if not scheduler_output.total_num_scheduled_tokens:
                    return out  # vLLM reads an empty step's output from execute_model
                self._pending = out
                return None  # its output comes from sample_tokens
            self._async.drain()  # a grammar step runs on its own (two phases)
        if scheduler_output.has_structured_output_requests:
            self._call("execute_model", scheduler_output=wire, defer_sampling=True, step_id=self._step_id)
            self._deferred = True
            return None
        out = self._call("execute_model", scheduler_output=wire, step_id=self._step_id)
        self._step_id += 1  # only once applied: a rejected step changed nothing and keeps its number
        return self._output(out)

    def _async_output(self, wire: dict) -> Any:
        def output(out: dict | BaseException) -> Any:  # the record followed the reply as it was read (async_steps.py)
            if isinstance(out, SidecarLost):
                raise out
            if isinstance(out, BaseException):
                raise SidecarLost(f"{self.sidecar.where} was lost with steps in flight ({out})") from out
            return self._output(out)
        return output

    @staticmethod
    def _output(out: dict) -> Any:
        result = convert.model_runner_output(out)
        if out.get("kv_connector_output"):  # a disk-tier load failed: vLLM recomputes these blocks
            from vllm.v1.outputs import KVConnectorOutput

            result.kv_connector_output = KVConnectorOutput(
                invalid_block_ids=set(out["kv_connector_output"].get("invalid_block_ids") or ()))
        return result

    def sample_tokens(self, grammar_output: Any) -> Any:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        if not self._deferred:
            raise RuntimeError("sample_tokens without a deferred execute_model")
        out = self._call("sample_tokens", grammar_output=convert.grammar_output(grammar_output), step_id=self._step_id)
        self._deferred = False
        self._step_id += 1
        return self._output(out)

    def take_draft_token_ids(self) -> Any:
        try:
            return convert.draft_token_ids(self._call("take_draft_token_ids"))
        except RemoteError as e:
            if e.status == 404:  # a sidecar without speculative decoding
                return None
            raise

    def execute_dummy_batch(self) -> None:
        pass  # an idle data parallel rank: no collective to join (sidecar/vllm/dp.py)

    def check_health(self) -> None:
        self._call("check_health")

    def get_kv_connector_handshake_metadata(self) -> None:
        return None  # the store connector exchanges nothing between workers

    # --- LoRA (adapter paths are resolved under the sidecar's --lora-dir) -----------------------

    def _load_loras(self, so: Any) -> None:
        # vLLM's own runners load a request's adapter on first sight; so does this one.
        for r in so.scheduled_new_reqs:
            lr = r.lora_request
            if lr is not None and lr.lora_int_id not in self._loras:
                self.add_lora(lr)

    def add_lora(self, lora_request: Any) -> bool:
        ok = bool(self._call("add_lora", lora_request=convert.lora_request(lora_request)))
        self._loras.add(lora_request.lora_int_id)
        return ok or lora_request.lora_int_id in set(self._call("list_loras"))

    def remove_lora(self, lora_id: int) -> bool:
        self._loras.discard(lora_id)
        return bool(self._call("remove_lora", lora_id=lora_id))

    def pin_lora(self, lora_id: int) -> bool:
        return bool(self._call("pin_lora", lora_id=lora_id))

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras"))

    # --- sleep, profile, misc -----------------------------------------------------------------

    def discard(self, tags: tuple[str, ...]) -> None:
        raise Unsupported("discard (dropping memory without sleeping) is not supported by the MLX sidecar; "
                          "use sleep(level=1 or 2) and wake_up")

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags=tags)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None, **kwargs: Any) -> None:
        path = self._call("profile", is_start=is_start)
        if path:
            log.info("sidecar profile written to %s (on the sidecar's host)", path)

    def get_cache_block_size_bytes(self) -> int:
        return self._call("get_cache_block_size_bytes")

    def vocab_size(self) -> int:
        return self._call("vocab_size")

    def get_model(self) -> Any:
        raise Unsupported("the model lives in the MLX sidecar; there is no torch module in this process "
                          f"(its description: {self._call('get_model')})")

    def get_model_inspection(self) -> str:
        """What `repr(llm)` shows: the sidecar's description of its model."""
        m = self._call("get_model")
        return f"MLX sidecar at {self.remote.url}: " + ", ".join(f"{k}={v}" for k, v in m.items())

    def shutdown(self) -> None:
        # The sidecar keeps its model (another vLLM may re-initialise it); only the connection closes.
        if self._async is not None:
            self._async.close()
        self.remote.close()
