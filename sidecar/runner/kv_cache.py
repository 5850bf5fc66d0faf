"""The paged KV block pool and the attention cache adapter that unmodified mlx-lm models accept.

Each layer owns a slot pool `[1, num_kv_heads, num_blocks * block_size + 1, head_dim]` for K and
for V, allocated once (head-major, so a run of slots reads in place: attention.py). The extra
last slot is a sink for the writes of padding positions, so a padded batch never touches a real
block. Slot of position p of a request:
`block_ids[p // block_size] * block_size + p % block_size` (vLLM's slot mapping).

Per step the runner builds one `BatchLayout` (slots to write, slots to gather, per-row offsets
and the mask); every layer's `PagedCache` scatters its new K/V into its pool in place (MLX
donates the pool buffer: the step never copies it, so step cost does not grow with the pool),
reads each row's blocks (a slice of the pool when they are one run, else a gather: attention.py)
and lets the model run `mx.fast.scaled_dot_product_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np

from sidecar.runner import attention

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class LayerSpec:
    """vLLM's KVCacheSpec for one attention layer."""

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * DTYPES[self.dtype].size

    def to_wire(self) -> dict:
        return {
            "type": "sliding_window" if self.sliding_window else "full_attention",
            "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size, "head_size_v": self.head_size_v, "dtype": self.dtype,
            "sliding_window": self.sliding_window, "page_size_bytes": self.page_size_bytes,
        }


class KVPool:
    def __init__(self, specs: Sequence[LayerSpec], num_blocks: int):
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = specs[0].block_size
        self.sink = num_blocks * self.block_size  # the padding slot
        slots = self.sink + 1
        self.keys = [mx.zeros((1, s.num_kv_heads, slots, s.head_size), DTYPES[s.dtype]) for s in specs]
        self.values = [mx.zeros((1, s.num_kv_heads, slots, s.head_size_v), DTYPES[s.dtype]) for s in specs]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values


@dataclass
class BatchLayout:
    """One padded batch [B, L]: row b computes positions start[b] .. start[b] + n[b] - 1."""

    offsets: mx.array  # [B] start positions (RoPE offsets)
    write_slots: mx.array  # [B * L]
    reads: attention.ReadPlan  # every row's blocks: K slots, a multiple of block_size (or the context)
    query_pos: mx.array  # [B, L]
    ctx_lens: mx.array  # [B]
    # Every row has the same context and length: the read is cut to exactly the context and the
    # mask is None (decode) or "causal" (prefill), which lets SDPA take its unmasked/causal path.
    uniform: bool = False
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, starts: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sink: int) -> BatchLayout:
        starts_np = np.asarray(starts, np.int64)
        n = np.asarray(lengths, np.int64)
        B, L = len(starts), int(n.max())
        ctx = starts_np + n
        nblk = int(-(-ctx.max() // block_size))
        table = np.zeros((B, nblk), np.int64)  # short tables pad with block 0: read but masked out
        for b, t in enumerate(tables):
            k = min(len(t), nblk)
            table[b, :k] = t[:k]
        pos = starts_np[:, None] + np.arange(L)[None, :]
        valid = np.arange(L)[None, :] < n[:, None]
        blk = np.take_along_axis(table, np.minimum(pos // block_size, nblk - 1), axis=1)
        write = np.where(valid, blk * block_size + pos % block_size, sink)
        uniform = bool((ctx == ctx[0]).all() and (n == L).all())
        reads = attention.plan_reads(table, ctx, block_size, int(ctx[0]) if uniform else nblk * block_size, sink + 1)
        return cls(
            offsets=mx.array(starts_np.astype(np.int32)), write_slots=mx.array(write.reshape(-1).astype(np.int32)),
            reads=reads, query_pos=mx.array(pos.astype(np.int32)),
            ctx_lens=mx.array(ctx.astype(np.int32)), uniform=uniform,
        )

    def mask(self, window: int | None = None) -> mx.array | str | None:
        """[B, 1, L, K] bool. Padding queries see the row's whole context, so no row is all-masked."""
        if self.uniform and (window is None or window >= self.reads.length):
            return None if self.query_pos.shape[1] == 1 else "causal"
        if window not in self._masks:
            keys = mx.arange(self.reads.length)[None, None, :]
            q = self.query_pos[:, :, None]
            m = (keys <= q) & (keys < self.ctx_lens[:, None, None])
            if window:
                m = m & (keys > q - window)
            self._masks[window] = m[:, None]
        return self._masks[window]


class PagedCache:
    """The mlx-lm cache contract over the block pool: `offset`, `update_and_fetch`, `make_mask`."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout):
        self.pool, self.layer, self.layout = pool, layer, layout

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, i, lay = self.pool, self.layer, self.layout
        pool.keys[i] = attention.write(pool.keys[i], lay.write_slots, keys)
        pool.values[i] = attention.write(pool.values[i], lay.write_slots, values)
        return attention.read(pool.keys[i], lay.reads, keys.dtype), attention.read(pool.values[i], lay.reads, values.dtype)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self.layout.mask(window_size)

    @property
    def state(self) -> list[mx.array]:
        return [self.pool.keys[self.layer], self.pool.values[self.layer]]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False
