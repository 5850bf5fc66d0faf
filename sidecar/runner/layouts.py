"""Building a step's `BatchLayout` cheaply when the step is a decode (one token per row).

`BatchLayout.build` is general (prefill chunks, padding, windows, chunks) and costs ~0.1 ms of
numpy per call, about a sixth of a small model's whole forward. A decode row of a full-attention
layer needs three numbers (its position, its slot, its context length): they are computed in
plain Python here (a multi-row decode still builds its [B, K] gather slots with numpy). The
result is field for field what `BatchLayout.build` gives (tests/runner/test_layouts.py checks it).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from sidecar.runner import attention
from sidecar.runner.kv_cache import BatchLayout


def _is_run(table: Sequence[int], n: int) -> bool:
    first = table[0]
    return n < 2 or list(table[:n]) == list(range(first, first + n))


class LayoutBuilder:
    def build(self, starts: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sink: int, *, window: int | None = None, chunk: int | None = None,
              scalar: bool = False) -> BatchLayout:
        if window or chunk or scalar or any(n != 1 for n in lengths):
            return BatchLayout.build(starts, lengths, tables, block_size, sink, window=window, chunk=chunk,
                                     scalar=scalar)
        B = len(starts)
        ctx = [s + 1 for s in starts]
        K = max(ctx)
        write = [t[s // block_size] * block_size + s % block_size for s, t in zip(starts, tables)]  # tables validated
        if B == 1 and _is_run(tables[0], -(-ctx[0] // block_size)):
            reads = attention.ReadPlan(K, tables[0][0] * block_size, None)
        else:
            reads = self._plan(ctx, tables, block_size, sink, K)
        return BatchLayout(
            offsets=mx.array(list(starts), dtype=mx.int32), write_slots=mx.array(write, dtype=mx.int32),
            reads=reads, query_pos=mx.array([[s] for s in starts], dtype=mx.int32),
            ctx_lens=mx.array(ctx, dtype=mx.int32), uniform=all(c == ctx[0] for c in ctx),
            write_start=write[0] if B == 1 else None,
        )

    @staticmethod
    def _plan(ctx: list[int], tables: Sequence[Sequence[int]], block_size: int, sink: int, K: int) -> attention.ReadPlan:
        nblk = -(-K // block_size)
        table = np.zeros((len(ctx), nblk), np.int64)
        for b, t in enumerate(tables):
            k = min(len(t), nblk)
            table[b, :k] = t[:k]
        kpos = np.arange(K)
        slots = table[:, kpos // block_size] * block_size + kpos % block_size
        return attention.plan_reads(np.where(kpos[None, :] < np.asarray(ctx)[:, None], slots, sink))
