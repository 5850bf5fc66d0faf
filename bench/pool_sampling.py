"""Two scenarios on one server's pool and sampler: decode step time against pool size (the step
must not cost more with a bigger pool), and a 64-row step of mixed sampling against greedy."""

from __future__ import annotations

from typing import Callable

from bench.scenarios import Bench, median, mixed_sampling
from bench.sides import SidecarSide, requests_for


# ---------------------------------------------------------------- 5. pool size


def physical_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def pool_size(b: Bench, make_side: Callable[[dict], SidecarSide]) -> None:
    p = b.params
    side = b.sidecar
    per_block = side.block_bytes()
    need = per_block * p.pool_large_blocks
    mem = physical_memory()
    kv_dtype = "auto"
    if mem and need > 0.4 * mem:
        # Tight: a separate server with a float16 pool for both sizes (same dtype on both sides).
        kv_dtype = "float16"
        side = make_side({"kv_dtype": "float16"})
        per_block = side.block_bytes()
        b.notes.append(f"pool_size: {p.pool_large_blocks} blocks would take {need / 2**30:.1f} GiB of "
                       f"{mem / 2**30:.1f}; measured on a separate server with --kv-dtype float16")
    steps: dict[int, list[float]] = {p.pool_small_blocks: [], p.pool_large_blocks: []}
    client: dict[int, list[float]] = {p.pool_small_blocks: [], p.pool_large_blocks: []}
    alloc: dict[int, float] = {}
    # Small runs, then the large ones, then small again: the large pool is allocated once (16 s
    # for 6 GB on 2 CPU cores), and the small runs on both sides of it cancel a drift in speed.
    r = p.pool_repeats
    plan = [p.pool_small_blocks] * (r - r // 2) + [p.pool_large_blocks] * r + [p.pool_small_blocks] * (r // 2)
    current = None
    for blocks in plan:
        if blocks != current:
            alloc[blocks] = side.initialize_cache(blocks)
            current = blocks
        n0 = len(side.worker.records)
        prompts = b.prompts([p.pool_prompt_len] * p.pool_batch)
        side.run(requests_for(prompts, p.pool_steps + 1), tag=f"pool{blocks}", probe=True)
        recs = [r for r in side.worker.records[n0:] if r.decode][1:]  # the first decode step warms up
        steps[blocks] += [(r.server_s if r.server_s is not None else r.client_s) * 1e3 for r in recs]
        client[blocks] += [r.client_s * 1e3 for r in recs]
        b.log(f"pool {blocks} blocks: decode step (batch {p.pool_batch}) {median(steps[blocks][-len(recs):]):.2f} ms")
    if side is b.sidecar:
        side.initialize_cache(p.server_blocks)  # back to the pool the other scenarios use
    small, large = median(steps[p.pool_small_blocks]), median(steps[p.pool_large_blocks])
    b.results.update(
        pool_size_ratio=large / small, pool_small_step_ms=small, pool_large_step_ms=large,
        pool_small_blocks=p.pool_small_blocks, pool_large_blocks=p.pool_large_blocks,
        pool_large_bytes=float(per_block * p.pool_large_blocks), pool_kv_dtype=kv_dtype,
        pool_small_client_step_ms=median(client[p.pool_small_blocks]),
        pool_large_client_step_ms=median(client[p.pool_large_blocks]),
        pool_small_initialize_s=alloc[p.pool_small_blocks], pool_large_initialize_s=alloc[p.pool_large_blocks],
    )
    b.raw["pool_small_step_ms"], b.raw["pool_large_step_ms"] = steps[p.pool_small_blocks], steps[p.pool_large_blocks]


# ---------------------------------------------------------------- 6. mixed sampling


def sampling(b: Bench) -> None:
    p = b.params
    n = p.sampling_rows
    steps: dict[str, list[float]] = {"greedy": [], "mixed": []}
    w = b.sidecar.worker
    # The decode-ahead's use (rows), per kind.
    ahead: dict[str, list[int]] = {"greedy": [0, 0], "mixed": [0, 0]}
    for i in range(p.sampling_repeats):
        for kind in (("greedy", "mixed") if i % 2 == 0 else ("mixed", "greedy")):
            params = mixed_sampling(n) if kind == "mixed" else None
            n0 = len(w.records)
            a0 = w.ahead_counts()
            b.sidecar.run(requests_for(b.prompts([p.sampling_prompt_len] * n), p.sampling_steps + 1, params),
                          tag=f"sampling_{kind}", max_num_seqs=n, probe=True)
            a1 = w.ahead_counts()
            if a0 is not None and a1 is not None:
                ahead[kind] = [ahead[kind][0] + a1[0] - a0[0], ahead[kind][1] + a1[1] - a0[1]]
            recs = [r for r in w.records[n0:] if r.decode and r.rows == n][1:]
            steps[kind] += [(r.server_s if r.server_s is not None else r.client_s) * 1e3 for r in recs]
        b.log(f"sampling {i + 1}/{p.sampling_repeats}: {n}-row decode step {median(steps['greedy']):.1f} ms greedy, "
              f"{median(steps['mixed']):.1f} ms mixed")
    g, m = median(steps["greedy"]), median(steps["mixed"])
    b.results.update(sampling_mixed_ratio=m / g, sampling_greedy_step_ms=g, sampling_mixed_step_ms=m,
                     sampling_rows=n)
    for kind in ("greedy", "mixed"):  # rows whose decode forward was computed ahead / computed for nothing
        b.results[f"sampling_{kind}_ahead_hits"], b.results[f"sampling_{kind}_ahead_misses"] = ahead[kind]
    b.raw["sampling_greedy_step_ms"], b.raw["sampling_mixed_step_ms"] = steps["greedy"], steps["mixed"]
