"""The cache list one padded batch's forward takes: an adapter per cache leaf, nested like the
model's own `make_cache()` (CacheList where it has one), each reading its KV cache group's tables."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from sidecar.kv.pool import BatchLayout, KVPool, PagedCache
from sidecar.kv.quant import QuantizedPagedCache
from sidecar.kv.spec import STATE, ModelCaches
from sidecar.engine.state import Row
from sidecar.kv.state_cache import gather_state, store_state


def step_batches(rows: Sequence[Row], decode: list[int], prefill: list[int], caches: ModelCaches) -> list[list[int]]:
    """How rows run as batches (some may be empty). Models that cannot take padding get batches
    without it: recurrent state (rows of equal length, fresh rows apart from continuing ones) or
    int offsets (one row at a time), and so do rows past `rows_apart_past`. Others run the decode
    rows as one batch and the prefill rows in padded batches that compute at most `PAD_SLACK` x
    their real tokens (longest first)."""
    past = caches.rows_apart_past
    if caches.scalar_offsets or (past is not None and any(rows[i].start + len(rows[i].token_ids) > past
                                                          for i in decode + prefill)):
        return [[i] for i in decode + prefill]
    if caches.has_state:
        out: dict[tuple[int, bool], list[int]] = {}
        for i in decode + prefill:
            out.setdefault((len(rows[i].token_ids), rows[i].start == 0), []).append(i)
        return list(out.values())
    groups: list[list[int]] = [decode]
    real = 0
    for i in sorted(prefill, key=lambda i: -len(rows[i].token_ids)):
        n = len(rows[i].token_ids)
        if len(groups) > 1 and (len(groups[-1]) + 1) * len(rows[groups[-1][0]].token_ids) <= PAD_SLACK * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


PAD_SLACK = 1.25


# A batch's attention gathers rows x longest context key slots per layer (BatchLayout.reads). Rows
# that share blocks (a common prefix) can make that far more than the pool holds, and the memory
# profile never ran it: a batch reads at most this many pools' worth of slots, else it is split.
READ_POOLS = 4


def read_limit(num_slots: int, max_model_len: int) -> int:
    """Key slots one batch may read per layer: READ_POOLS x the pool's, at least one full context."""
    return max(READ_POOLS * num_slots, max_model_len)


def read_bounded(rows: Sequence[Row], idx: list[int], limit: int) -> list[list[int]]:
    """`idx` as one batch when its padded read (rows x longest context) is within `limit`, else
    batches of rows of similar context that each are (a row alone always is: its context is at
    most max_model_len). Rows are independent, so results do not depend on the split."""
    if not idx or len(idx) * max(rows[i].end for i in idx) <= limit:
        return [idx]
    out: list[list[int]] = [[]]
    for i in sorted(idx, key=lambda i: rows[i].end):  # (each batch's longest row is its last)
        if out[-1] and (len(out[-1]) + 1) * rows[i].end > limit:
            out.append([])
        out[-1].append(i)
    return out


def build_caches(mc: ModelCaches, pool: KVPool, group_of: Sequence[int], rows: Sequence[Row],
                 lengths: Sequence[int], build: Callable[..., BatchLayout] = BatchLayout.build,
                 ) -> tuple[list[Any], Callable[[], None]]:
    """(cache list, store): `store()` after the forward writes the rows' new recurrent states back.
    `build` makes each layout."""
    ngroups = max(group_of) + 1
    tables = [r.tables(ngroups) for r in rows]
    starts = [r.start for r in rows]
    scalar = mc.scalar_offsets and len(rows) == 1
    layouts: dict[tuple, BatchLayout] = {}
    adapters: list[Any] = []
    stores = []
    for leaf, spec in enumerate(pool.specs):
        g = group_of[leaf]
        if spec.kind == STATE:
            slots = mx.array([t[g][0] for t in tables], dtype=mx.int32)
            size, used = mc.state_entries[leaf]
            fresh = all(s == 0 for s in starts)
            c = gather_state(mc.templates[leaf], size, used, pool, leaf, None if fresh else slots)
            stores.append((c, used, leaf, slots))
        else:
            key = (g, spec.sliding_window, spec.attention_chunk_size)
            if key not in layouts:
                layouts[key] = build(starts, lengths, [t[g] for t in tables], pool.block_size, pool.sink,
                                     window=spec.sliding_window, chunk=spec.attention_chunk_size, scalar=scalar)
            c = (QuantizedPagedCache if spec.kv_bits else PagedCache)(pool, leaf, layouts[key], mc.mask_5d)
        adapters.append(c)
    cache_list = [adapters[s] if isinstance(s, int) else CacheList(*(adapters[j] for j in s)) for s in mc.structure]

    def store() -> None:
        for c, used, leaf, slots in stores:
            store_state(c, used, pool, leaf, slots)

    return cache_list, store


def probe_batched(runner: Any) -> None:
    """Rows of different lengths in one padded batch must give each row's logits alone. Models
    that take positions from the cache offset with numpy (gpt_bigcode: an error) or from the
    length of the keys read (afm7: silently wrong) cannot take per-row offsets and padding: they
    run one row at a time. A model that differs even so is refused, naming why."""
    import numpy as np

    from sidecar.kv.spec import UnsupportedModel
    from sidecar.engine.state import RequestState
    from sidecar.engine.sampler import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [1, 2, 3]]

    def run(together: bool) -> list[np.ndarray]:
        """Prefill both prompts, then decode one token each, in shared batches or one row each;
        the logits of both steps."""
        pool, saved = runner.pool, runner.requests
        try:
            per = -(-(len(prompts[0]) + 1) // runner.specs[0].block_size)  # blocks for a prompt and its decode
            runner.pool, runner.requests = KVPool(runner.specs, per * len(prompts)), {}
            greedy = SamplingParams(temperature=0.0)
            states = [RequestState(f"probe-{i}", p, greedy, list(range(per * i, per * (i + 1))))
                      for i, p in enumerate(prompts)]
            out: list = []
            for step in range(2):
                rows = [Row(s, 0, s.prompt_token_ids, s.block_ids, True) if step == 0 else
                        Row(s, len(s.prompt_token_ids), [7], s.block_ids, True) for s in states]
                idx = list(range(len(rows)))
                batches = (step_batches(rows, idx if step else [], [] if step else idx, runner.caches) if together
                           else [[i] for i in idx])
                last: list = [None] * len(rows)
                stores: list = []
                for b in filter(None, batches):
                    runner.forward([rows[i] for i in b], b, last, {}, stores=stores)
                for store in stores:
                    store()
                out += [np.array(x[0].astype(mx.float32)) for x in last]
            return out
        finally:
            runner.pool, runner.requests = pool, saved

    def exact() -> bool:
        return all(np.allclose(a, b, rtol=1e-3, atol=1e-3 * (1 + float(np.abs(a).max())))
                   for a, b in zip(run(False), run(True)))

    try:
        if exact():
            return
        problem = "the batched forward differs from each row's alone"
    except Exception as e:
        problem = f"the model's forward fails through the paged cache: {type(e).__name__}: {e}"
    if not runner.caches.scalar_offsets:
        runner.caches.scalar_offsets = True
        runner.decode_ahead = False
        try:
            if exact():
                return
        except Exception as e:
            problem = f"the model's forward fails through the paged cache: {type(e).__name__}: {e}"
    raise UnsupportedModel(problem, field="model")
