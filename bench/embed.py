"""Embedding throughput: prompt tokens/s of last-token-pooled embeddings, the sidecar (a server
with `--runner pooling`, driven by the reference scheduler with pooling requests) against mlx-lm's
own batched forward (its decoder over the right-padded batch, the last real position of each row
taken and normalised), at batch 1 (requests one after another) and batch `embed_batch` (all at
once). Prompts of `embed_prompt_min`..`embed_prompt_max` tokens. Both sides' vectors are compared
(`embed_max_abs_diff`). Keys: `embed_b<n>_{sidecar,mlx_lm}_tok_s`, `embed_b<n>_ratio`.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import numpy as np

from bench.scenarios import Bench, alternate, median
from bench.sides import MlxLmSide, SidecarSide, fresh_id
from sidecar.scheduler import Request


def _prompts(b: Bench) -> list[list[int]]:
    p = b.params
    rng = random.Random(p.seed + 25)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(p.embed_prompt_min, p.embed_prompt_max))]
            for _ in range(p.embed_batch)]


def _sidecar(side: SidecarSide, prompts: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    out: list[list[float]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        reqs = [Request(fresh_id("e"), p, {}, max_tokens=1, pooling_params={"pooling_type": "LAST"})
                for p in prompts[i : i + batch]]
        _, sched = side.run(reqs, tag="embed", max_num_seqs=batch)
        out += [r.pooled for r in reqs]  # type: ignore[misc]
        assert sched is not None
    return time.perf_counter() - t0, out


def _mlx_lm(mlx: MlxLmSide, prompts: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    import mlx.core as mx

    decoder = mlx.model.model
    out: list[list[float]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps = prompts[i : i + batch]
        lengths = [len(p) for p in ps]
        ids = np.zeros((len(ps), max(lengths)), np.int32)
        for j, p in enumerate(ps):
            ids[j, : len(p)] = p  # right padding: a causal decoder's real positions never see it
        h = decoder(mx.array(ids))
        last = h[mx.arange(len(ps)), mx.array(lengths) - 1].astype(mx.float32)
        vecs = last / mx.linalg.norm(last, axis=-1, keepdims=True)
        out += vecs.tolist()
    return time.perf_counter() - t0, out


def embeddings(b: Bench, make_side: Callable[[dict[str, Any]], SidecarSide]) -> None:
    p = b.params
    side = make_side({"runner": "pooling", "max_num_seqs": p.embed_batch})
    prompts = _prompts(b)
    tokens = sum(map(len, prompts))
    _sidecar(side, prompts[:2], 2)  # warm-up, both sides
    _mlx_lm(b.mlx, prompts[:2], 2)
    for batch in (1, p.embed_batch):
        rates: dict[str, list[float]] = {"sidecar": [], "mlx": []}
        diff = 0.0
        for i in range(p.embed_repeats):
            got = {}
            for who in alternate(i):
                secs, vecs = _sidecar(side, prompts, batch) if who == "sidecar" else _mlx_lm(b.mlx, prompts, batch)
                rates[who].append(tokens / secs)
                got[who] = np.asarray(vecs)
            diff = max(diff, float(np.abs(got["sidecar"] - got["mlx"]).max()))
            b.log(f"embeddings batch {batch} {i + 1}/{p.embed_repeats}: sidecar {rates['sidecar'][-1]:.0f} tok/s, "
                  f"mlx-lm {rates['mlx'][-1]:.0f} tok/s")
        key = f"embed_b{batch}" if batch == 1 else "embed_batch"
        b.results[f"{key}_sidecar_tok_s"] = median(rates["sidecar"])
        b.results[f"{key}_mlx_lm_tok_s"] = median(rates["mlx"])
        b.results[f"{key}_ratio"] = median([s / m for s, m in zip(rates["sidecar"], rates["mlx"])])
        b.results["embed_max_abs_diff"] = max(diff, b.results.get("embed_max_abs_diff", 0.0))
    b.results["embed_batch_requests"] = p.embed_batch
