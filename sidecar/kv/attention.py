"""The paged cache's read and write paths: where a batch's K/V go in the pool and come from.

The pool of one layer is head-major, `[1, num_kv_heads, slots, head_dim]` (slot as in
pool.py: `block * block_size + offset`; the leading 1 makes a read one slicing op, as
mlx-lm's cache read is), so a run of consecutive slots is, for every head, one contiguous stretch
of memory: exactly the layout of mlx-lm's own KVCache buffer
(`[B, H, T, D]`, read as `keys[..., :offset, :]`). A row whose blocks are one run of consecutive
block ids (what a block allocator hands out most of the time: the reference scheduler's does for
a stream on a fresh or recycled pool) is then read in place: a slice of the pool, no copy, no
gather, and `mx.fast.scaled_dot_product_attention` reads it as it reads mlx-lm's cache.

Everything else (a batch of several rows, or a row whose blocks are scattered) is gathered once
per layer into a contiguous `[B, H, K, D]`. (Token-major K/V, `[B, K, H, D]` transposed, is a
strided input that MLX's GQA attention handles several times slower than a contiguous one: that,
not the gather itself, was most of the long-context cost.)

A `SlotPlan` says which slots a batch writes (`plan_writes`) or reads (`plan_reads`); it is made
once per layout from the rows' block tables and shared by every layer using that layout, as is
the flat `[B, H, K]` index a write's scatter or a read's gather takes (one index array on one axis:
indexing `[:, :, slots]` instead builds a dozen small index ops around every scatter, per layer
and K/V). `write` and `read` are what `PagedCache.update_and_fetch` calls. A window or an attention
chunk reads from its first visible block, so its run check covers only the keys it reads. Slots are
worked out per block, not per key (`slots`): a step's host work does not grow with the context. A fused
paged-attention kernel (Metal) would replace `read` + attention behind the same seam; none is
shipped (no Metal machine here to verify one against this path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SlotPlan:
    """The K slots per row every layer writes or reads, `[B, H, K, D]`."""

    length: int  # K
    start: int | None  # one row, one run: its first slot (a slice)
    slots: mx.array | None  # otherwise: [B, K] slots scattered or gathered
    _index: dict = field(default_factory=dict, compare=False, repr=False)  # "start" -> [1]; (H, S) -> [B, H, K]

    @property
    def in_place(self) -> bool:
        return self.start is not None

    @property
    def start_index(self) -> mx.array:
        """[1] the first slot of a run (made once per plan)."""
        idx = self._index.get("start")
        if idx is None:
            idx = self._index["start"] = mx.array([self.start], dtype=mx.int32)
        return idx

    def flat_index(self, H: int, S: int) -> mx.array:
        """[B, H, K]: the rows' slots in a pool seen as `[H * S, D]` (made once per pool shape)."""
        idx = self._index.get((H, S))
        if idx is None:
            heads = (mx.arange(H, dtype=mx.int32) * S)[None, :, None]
            idx = self._index[H, S] = self.slots[:, None, :] + heads  # type: ignore[index]
        return idx

    def slot_array(self) -> mx.array:
        if self.slots is not None:
            return self.slots
        return mx.arange(self.start, self.start + self.length, dtype=mx.int32)[None]  # type: ignore[operator]


def run_start(table: Sequence[int], lo: int, hi: int, block_size: int) -> int | None:
    """The slot of position `lo` when positions lo .. hi - 1 lie in consecutive block ids, else None."""
    j0, j1 = lo // block_size, (hi - 1) // block_size
    first = table[j0]
    if j1 > j0 and list(table[j0 : j1 + 1]) != list(range(first, first + j1 - j0 + 1)):
        return None
    return first * block_size + lo % block_size


def slots(tables: Sequence[Sequence[int]], lo: Sequence[int], hi: Sequence[int], width: int, block_size: int,
          sink: int) -> np.ndarray:
    """[B, width] int32: the slot of position lo[b] + i of row b (from hi[b] on: the padding slot).
    Worked out per block: each row's blocks from the one holding lo[b], as many as `width` spans."""
    bs, B = block_size, len(tables)
    if width == 1:  # a decode's write: one slot per row
        return np.array([t[p // bs] * bs + p % bs if p < h else sink for t, p, h in zip(tables, lo, hi)],
                        np.int32).reshape(B, 1)
    off = [p % bs for p in lo]
    nb = -(-(max(off) + width) // bs)
    flat: list[int] = []
    for t, p in zip(tables, lo):
        row = t[p // bs : p // bs + nb]
        flat += row
        if len(row) < nb:  # past a short table's end: block 0, replaced by the sink below
            flat += [0] * (nb - len(row))
    blocks = np.array(flat, np.int32).reshape(B, nb)
    out = (blocks[:, :, None] * bs + np.arange(bs, dtype=np.int32)).reshape(B, nb * bs)
    cols = np.arange(width, dtype=np.int32)
    out = out[:, :width] if not any(off) else out[np.arange(B)[:, None], cols + np.array(off, np.int32)[:, None]]
    n = [h - p for p, h in zip(lo, hi)]
    if any(k < width for k in n):
        out = np.ascontiguousarray(out)
        out[cols >= np.array(n, np.int32)[:, None]] = sink
    return out


def plan_reads(tables: Sequence[Sequence[int]], lo: Sequence[int], hi: Sequence[int], width: int,
               block_size: int, sink: int) -> SlotPlan:
    """Row b reads positions lo[b] .. lo[b] + width - 1 (from hi[b] on: the padding slot, masked).
    One row whose blocks are one run is read in place."""
    return _plan(tables, lo, hi, width, block_size, sink)


def plan_writes(tables: Sequence[Sequence[int]], starts: Sequence[int], lengths: Sequence[int],
                block_size: int, sink: int) -> SlotPlan:
    """Row b writes positions starts[b] .. + lengths[b] - 1 (a shorter row's padding queries: the
    padding slot). One row whose slots are one run is written as a slice, as mlx-lm's cache."""
    ctx = [s + n for s, n in zip(starts, lengths)]
    return _plan(tables, starts, ctx, max(lengths), block_size, sink)


def _plan(tables: Sequence[Sequence[int]], lo: Sequence[int], hi: Sequence[int], width: int,
          block_size: int, sink: int) -> SlotPlan:
    if len(tables) == 1 and hi[0] - lo[0] == width:
        start = run_start(tables[0], lo[0], hi[0], block_size)
        if start is not None:
            return SlotPlan(width, start, None)
    return SlotPlan(width, None, mx.array(slots(tables, lo, hi, width, block_size, sink)))


def write(pool: mx.array, plan: SlotPlan, new: mx.array) -> mx.array:
    """Scatter new [B, H, L, D] into the pool [1, H, S, D] at the plan's slots; returns the new
    pool array (its buffer the old one's: MLX donates it when nothing else holds it). The `pool`
    object itself is left as it was, so a caller holding the step's arrays still holds the step's."""
    _, H, S, D = pool.shape
    if D == 0:  # a keys-only cache's values (minimax_m3's indexer): nothing to store, and MLX
        return pool  # traps (SIGFPE) scattering or gathering zero-width rows
    if new.dtype != pool.dtype:
        new = new.astype(pool.dtype)
    if plan.start is not None:
        return mx.slice_update(pool, new, plan.start_index, axes=(2,))
    flat = pool.reshape(H * S, D)
    flat[plan.flat_index(H, S)] = new  # ([B, H, L] rows of D: exactly `new`'s shape)
    return flat.reshape(1, H, S, D)


def read(pool: mx.array, plan: SlotPlan, dtype: mx.Dtype) -> mx.array:
    """The batch's keys or values, [B, H, K, D] contiguous per head (a view of the pool when in place)."""
    if pool.shape[-1] == 0:  # zero-width values (see write)
        return mx.zeros((1 if plan.slots is None else plan.slots.shape[0], pool.shape[1], plan.length, 0), dtype)
    if plan.start is not None:
        out = pool[:, :, plan.start : plan.start + plan.length]
    else:
        # One gather whose result is already [B, H, K, D] row-major.
        _, H, S, D = pool.shape
        out = pool.reshape(H * S, D)[plan.flat_index(H, S)]
    return out if out.dtype == dtype else out.astype(dtype)
