"""Building a step's `BatchLayout` cheaply when the step is a decode (one token per row).

`BatchLayout.build` is general (prefill chunks, padding) and costs ~0.1 ms of numpy per call,
about a sixth of a small model's whole forward. A decode row needs three numbers (its position,
its slot, its context length): they are computed in plain Python here, and the gather plan of a
multi-row decode (its [B, K] slots, K a multiple of the block size) is kept from the previous
step while the block tables it read are unchanged (the usual case: a table grows by one block
every `block_size` steps). The result is field for field what `BatchLayout.build` gives
(tests/runner/test_layouts.py checks it).
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
    def __init__(self) -> None:
        self._key: tuple | None = None
        self._reads: attention.ReadPlan | None = None

    def build(self, starts: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sink: int) -> BatchLayout:
        if any(n != 1 for n in lengths):
            return BatchLayout.build(starts, lengths, tables, block_size, sink)
        B = len(starts)
        ctx = [s + 1 for s in starts]
        nblk = -(-max(ctx) // block_size)
        write = [t[s // block_size] * block_size + s % block_size for s, t in zip(starts, tables)]  # tables validated
        uniform = all(c == ctx[0] for c in ctx)
        reads = None
        if B == 1:
            n = -(-ctx[0] // block_size)
            start = tables[0][0] * block_size
            if start + ctx[0] <= sink + 1 and _is_run(tables[0], n):
                reads = attention.ReadPlan(ctx[0], start, None)
        if reads is None:
            length = ctx[0] if uniform else nblk * block_size
            key = (length, block_size, sink, tuple(tuple(t[:nblk]) for t in tables))
            if key != self._key or self._reads is None:
                table = np.zeros((B, nblk), np.int64)  # short tables pad with block 0, masked out
                for b, t in enumerate(tables):
                    k = min(len(t), nblk)
                    table[b, :k] = t[:k]
                self._reads = attention.plan_reads(table, np.asarray(ctx), block_size, length, sink + 1)
                self._key = key
            reads = self._reads
        return BatchLayout(
            offsets=mx.array(list(starts), dtype=mx.int32), write_slots=mx.array(write, dtype=mx.int32),
            reads=reads, query_pos=mx.array([[s] for s in starts], dtype=mx.int32),
            ctx_lens=mx.array(ctx, dtype=mx.int32), uniform=uniform,
        )
