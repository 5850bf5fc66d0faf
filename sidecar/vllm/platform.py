"""The vLLM platform of a host whose model runs in an MLX sidecar (`sidecar/vllm/plugin.py` activates it).

vLLM's CPU platform assumes the model runs in vLLM's own process on this CPU, and sets vLLM up for
that. Here the model runs in the sidecar, so with the sidecar's worker class this platform keeps
the CPU platform's process setup (torch on the CPU, the environment vLLM's processes need) and
changes what only made sense for a local model:

| setting | CPU platform | here | why |
|---|---|---|---|
| worker class (`--worker-cls` auto) | vLLM's CPU worker | `MLXSidecarWorker` | the model is in the sidecar |
| `--async-scheduling` | forced off | vLLM's own default (on), or as given | the worker sends step n + 1 before step n's reply is read, hiding vLLM's per-step work |
| `--block-size` (when not given) | 128 | 16 | vLLM's default elsewhere; the sidecar's paged attention has no preference for 128 |
| KV memory | `VLLM_CPU_KVCACHE_SPACE` when set | `--kv-cache-memory-bytes`, else the sidecar's `determine_available_memory` up to `--max-num-seqs` x `--max-model-len` tokens | the pool is in the sidecar's memory, not this host's; a pool of most of the free memory takes minutes to fill on a CPU backend |
| executor (`--distributed-executor-backend` not given) | a separate worker process (`mp`) | in the engine process (`uni`) | the worker only talks HTTP: a process hop per step less, and no busy-polling process on the CPU |
| torch threads | vLLM binds its CPU worker's OpenMP threads | left alone | no torch compute runs here |
| `--max-num-batched-tokens` (CLI, not given) | 2048 | 256 | the sidecar's warm-up shape: one prefill of this many tokens, measured at start-up (below) |
| `--max-num-seqs` (CLI, not given) | 128 | 32 | the decode batch the warm-up computes, and the KV pool's reach (worker.py) |

The warm-up shape: the sidecar measures its activation peak and warms up with one prefill of
`--max-num-batched-tokens` tokens and one decode batch of `--max-num-seqs` sequences. vLLM's CPU
defaults (2048, 128) take minutes on a CPU backend, where every prompt token costs about a decode
step; 256 and 32 take seconds there, and on a GPU cost prefill throughput only for prompts longer
than 256 tokens (chunked into steps of 256). Given flags always win; the defaults are the command
line's (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`): the offline `LLM(...)` class
takes vLLM's own unless given.

Speculative decoding: the sidecar proposes the drafts after each step, which vLLM only takes
between steps, so with a `speculative_config` async scheduling is turned off (logged) and steps
run one at a time; so do pooling models (`--runner pooling`) and a `--kv-transfer-config` (the disk
KV tier's connector: a failed load rewinds a request). With another `--worker-cls` this
platform is exactly vLLM's CPU platform.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms.cpu import CpuPlatform

log = logging.getLogger("vllm.mlx_sidecar")  # vLLM shows its own loggers' output only

WORKER_CLS = "sidecar.vllm.worker.MLXSidecarWorker"
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS = 256, 32  # the command line's defaults: the warm-up shape


class MLXSidecarPlatform(CpuPlatform):
    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        super().pre_register_and_update(parser)
        if parser is not None:  # vLLM's CLI parser: defaults only, a given flag wins
            parser.set_defaults(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        sc, cc, pc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.parallel_config
        ours = pc.worker_cls in ("auto", WORKER_CLS)
        before = (sc.async_scheduling, cc.kv_cache_memory_bytes, pc.distributed_executor_backend)
        super().check_and_update_config(vllm_config)
        if not ours:
            return
        pc.worker_cls = WORKER_CLS
        sc.async_scheduling, cc.kv_cache_memory_bytes, pc.distributed_executor_backend = before
        if not cc.user_specified_block_size:
            cc.block_size = BLOCK_SIZE
        if sc.async_scheduling and vllm_config.speculative_config is not None:
            log.warning("MLX sidecar: speculative decoding runs with async scheduling off (the sidecar's drafts "
                        "reach vLLM between steps): steps run one at a time")
            sc.async_scheduling = False
        one_at_a_time = [why for why, on in (
            ("pooling (vLLM reads pooled outputs from execute_model)",
             getattr(vllm_config.model_config, "runner_type", None) == "pooling"),
            ("a KV connector (a failed load rewinds a request the next step was scheduled past)",
             vllm_config.kv_transfer_config is not None)) if on]
        if sc.async_scheduling and one_at_a_time:
            log.info("MLX sidecar: async scheduling off for %s", "; ".join(one_at_a_time))
            sc.async_scheduling = False
        log.info("MLX sidecar platform: worker %s, async scheduling %s, block size %d, executor %s",
                 WORKER_CLS, "on" if sc.async_scheduling else "off", cc.block_size, pc.distributed_executor_backend)
