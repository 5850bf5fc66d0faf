"""Workload sizes for the bench (`python -m bench`): the full run, `--quick`, the issue's exact sizes, and tiny (tests).

MLX's CPU backend runs builtin:small at ~30-35 tokens/s whatever the batch (prefill and decode
alike: it is compute-bound at a few GFLOPS), so the issue's literal batch workload (32 prompts of
16-512 tokens, 128 new tokens each) costs ~6 minutes per side there. The default full run keeps
every scenario's shape and scales the token counts down to fit in 15 minutes on 2 CPU cores;
`MLX_SIDECAR_BENCH_PROFILE=spec` runs the issue's exact sizes (meant for a Metal/CUDA machine).
Every size used is recorded in the JSON under "params".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

PROFILE_ENV = "MLX_SIDECAR_BENCH_PROFILE"


@dataclass(frozen=True)
class BenchParams:
    profile: str = "full"
    model: str = "builtin:small"
    home: str | None = None
    seed: int = 0
    # The sidecar server(s): pool for every scenario but pool_size, and the scheduler's limits.
    server_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # 1. single stream: decode tokens/s, prefill excluded, median over repeats (sides alternate).
    single_prompt_len: int = 32
    single_new_tokens: int = 64
    single_repeats: int = 5
    # 2. batch: `batch_requests` concurrent requests, prompt lengths spread over [min, max].
    batch_requests: int = 32
    batch_prompt_min: int = 16
    batch_prompt_max: int = 128
    batch_new_tokens: int = 32
    batch_repeats: int = 1
    # 3. RPC overhead: decode steps at batch 1 (a dedicated run) and 64 (the sampling scenario's
    # 64-row steps, plus the sweep's when the server reports its own time in a header).
    rpc_b1_steps: int = 48
    rpc_null_calls: int = 100
    msgpack_requests: int = 256
    msgpack_repeats: int = 200
    # 4. prefix caching: TTFT of prefix+suffix with the prefix cached vs cold.
    prefix_len: int = 1024
    prefix_suffix_len: int = 16
    prefix_cold_repeats: int = 2
    prefix_warm_repeats: int = 3
    prefix_mlx_lm_reference: bool = True  # also time mlx-lm's cold TTFT on the same prompt
    # 5. pool size: decode step time with a large vs a small pool (A B A B ...).
    pool_small_blocks: int = 1024
    pool_large_blocks: int = 32768
    pool_batch: int = 4
    pool_prompt_len: int = 16
    pool_steps: int = 12
    pool_repeats: int = 2  # runs per pool size
    # 6. sampling: a `sampling_rows`-row decode step, every row different params vs all greedy.
    sampling_rows: int = 64
    sampling_prompt_len: int = 4
    sampling_steps: int = 4  # decode steps per phase; the first is dropped as warm-up
    sampling_repeats: int = 2  # greedy/mixed phase pairs
    # Throughput against concurrency, both sides.
    sweep_concurrency: tuple[int, ...] = (1, 4, 16, 32, 64)
    sweep_prompt_len: int = 8
    sweep_new_tokens: int = 16
    # 8. small-model single stream: per-step costs exposed (a ~1 ms forward), same measure as 1.
    # A run takes ~0.15 s, so one pair swings 0.65-1.9 with whatever else the 2 cores do: 9 pairs.
    tiny_model: str = "builtin:tiny"
    tiny_prompt_len: int = 32
    tiny_new_tokens: int = 256
    tiny_repeats: int = 9
    # 9. long-context decode: one stream decoding after `long_contexts` tokens of context, on a
    # model whose KV outgrows its weights (the context is prefilled once per length, then cached).
    long_model: str = "builtin:longctx"
    long_contexts: tuple[int, ...] = (1024, 4096, 16384)
    long_new_tokens: int = 32
    long_repeats: int = 3
    long_blocks: int = 1280  # the long-context server's pool (block_size 16): 16384 + decode fits
    long_kv8_context: int = 4096  # also decoded with 8-bit KV (kv_dtype 8bit) at this context (0: not)
    # 7. speculative decoding (spec.py): one greedy stream, n-gram proposer on vs off.
    spec_prompt_len: int = 64
    spec_new_tokens: int = 128
    spec_repeats: int = 3
    spec_k: int = 4
    spec_lookup_min: int = 2
    spec_lookup_max: int = 5
    spec_candidates: int = 4  # repetitive-prompt candidates probed
    spec_probe_tokens: int = 12
    # Embedding throughput (embed.py): last-token pooled prompts, batch 1 and `embed_batch`.
    embed_batch: int = 32
    embed_prompt_min: int = 64
    embed_prompt_max: int = 512
    embed_repeats: int = 2
    # vLLM's engine vs the reference scheduler over one sidecar (needs .venv-vllm).
    vllm: bool = True
    # Warm-up sizes (both sides).
    # the disk KV tier (kv_store.py): a shared prefix served from the store after a restart
    kv_store_prefix_len: int = 4096
    kv_store_new_tokens: int = 4
    kv_store_decode_tokens: int = 64
    kv_store_decode_repeats: int = 4
    kv_store_bound_blocks: int = 32  # the small store's bound, in entries; 3x it is written
    warmup_new_tokens: int = 8
    notes: tuple[str, ...] = field(default=())

    def replace(self, **kw: object) -> BenchParams:
        return dataclasses.replace(self, **kw)  # type: ignore[arg-type]

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def full(**kw: object) -> BenchParams:
    return BenchParams(**kw)  # type: ignore[arg-type]


def quick(**kw: object) -> BenchParams:
    return BenchParams(
        profile="quick", single_prompt_len=16, single_new_tokens=32, single_repeats=2,
        batch_requests=8, batch_prompt_min=8, batch_prompt_max=32, batch_new_tokens=16,
        rpc_b1_steps=24, msgpack_repeats=50, rpc_null_calls=40,
        prefix_len=256, prefix_cold_repeats=1, prefix_warm_repeats=2, prefix_mlx_lm_reference=False,
        pool_steps=8, pool_repeats=1,
        sampling_steps=3, sampling_repeats=1, sampling_prompt_len=2,
        sweep_prompt_len=4, sweep_new_tokens=4, warmup_new_tokens=4,
        tiny_new_tokens=128, tiny_repeats=5, long_contexts=(1024, 4096), long_new_tokens=24, long_repeats=2,
        spec_new_tokens=64, spec_repeats=1, spec_candidates=3, spec_probe_tokens=8,
        embed_prompt_max=128, embed_repeats=1,
        kv_store_prefix_len=512, kv_store_decode_tokens=32, kv_store_bound_blocks=16,
    ).replace(**kw)


def spec(**kw: object) -> BenchParams:
    """The issue's exact sizes (a GPU machine; ~25 minutes per side of the batch run on 2 CPU cores)."""
    return BenchParams(
        profile="spec", batch_prompt_min=16, batch_prompt_max=512, batch_new_tokens=128, batch_repeats=2,
        single_prompt_len=128, single_new_tokens=128, rpc_b1_steps=200,
        prefix_cold_repeats=3, prefix_warm_repeats=5, pool_steps=32, pool_repeats=3,
        sampling_steps=8, sampling_repeats=3, sweep_prompt_len=64, sweep_new_tokens=64,
        long_new_tokens=64, long_repeats=5,
    ).replace(**kw)


def tiny(**kw: object) -> BenchParams:
    """Seconds, for the smoke test on builtin:tiny: every scenario runs, nothing is meaningful."""
    return BenchParams(
        profile="tiny", model="builtin:tiny", server_blocks=512,
        single_prompt_len=8, single_new_tokens=6, single_repeats=1,
        batch_requests=4, batch_prompt_min=4, batch_prompt_max=12, batch_new_tokens=4,
        rpc_b1_steps=6, msgpack_repeats=3, rpc_null_calls=3,
        prefix_len=32, prefix_suffix_len=4, prefix_cold_repeats=1, prefix_warm_repeats=1,
        prefix_mlx_lm_reference=True,
        pool_small_blocks=64, pool_large_blocks=512, pool_batch=2, pool_prompt_len=4, pool_steps=4, pool_repeats=1,
        sampling_prompt_len=2, sampling_steps=3, sampling_repeats=1,
        sweep_concurrency=(1, 2, 4), sweep_prompt_len=4, sweep_new_tokens=3, warmup_new_tokens=2,
        tiny_prompt_len=8, tiny_new_tokens=6, tiny_repeats=1,
        long_model="builtin:tiny-kv64", long_contexts=(64, 200), long_new_tokens=4, long_repeats=1, long_blocks=64,
        long_kv8_context=200,
        spec_prompt_len=8, spec_new_tokens=8, spec_repeats=1, spec_candidates=2, spec_probe_tokens=4,
        embed_batch=4, embed_prompt_min=4, embed_prompt_max=12, embed_repeats=1,
        vllm=False,  # vLLM's start-up alone takes about a minute
        kv_store_prefix_len=64, kv_store_new_tokens=2, kv_store_decode_tokens=8, kv_store_decode_repeats=1,
        kv_store_bound_blocks=4,
    ).replace(**kw)


PRESETS = {"full": full, "quick": quick, "spec": spec, "tiny": tiny}


def from_cli(quick_flag: bool, **kw: object) -> BenchParams:
    name = os.environ.get(PROFILE_ENV, "").strip().lower() or ("quick" if quick_flag else "full")
    if name not in PRESETS:
        raise ValueError(f"{PROFILE_ENV}={name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name](**kw)
