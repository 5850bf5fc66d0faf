"""The paged KV block pool and the attention cache adapter that unmodified mlx-lm models accept.

Each layer owns a slot pool `[1, num_kv_heads, num_blocks * block_size + 2, head_dim]` for K and
for V, allocated once (head-major, so a run of slots reads in place: attention.py). Of the two
extra slots, the first is slot 0 of a scratch block (id `num_blocks`, no request can address it)
where a decode-ahead forward past a row's last block writes (overlap.py); the last is a sink
for the writes of padding positions, so a padded batch never touches a real block. Slot of position p of a request:
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

from sidecar.kv import attention
from sidecar.kv.spec import GROUP_SIZE, STATE, LayerSpec

__all__ = ["DTYPES", "BatchLayout", "KVPool", "LayerSpec", "PagedCache", "dtype_name"]

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


class KVPool:
    def __init__(self, specs: Sequence[LayerSpec], num_blocks: int):
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = specs[0].block_size
        self.scratch = num_blocks  # a block id of which only slot 0 exists (overlap.py)
        self.sink = num_blocks * self.block_size + 1  # the padding slot
        slots = self.sink + 1
        # Attention leaves: K and V slot pools. State leaves (recurrent layers): one state slot per
        # block id, addressed by the request's block in its state group (vLLM's layout).
        self.keys: list[mx.array | None] = []
        self.values: list[mx.array | None] = []
        self.states: list[list[mx.array] | None] = []
        for s in specs:
            if s.kind == STATE:
                self.keys.append(None)
                self.values.append(None)
                self.states.append([mx.zeros((num_blocks + 1, *shape), DTYPES[d])
                                    for shape, d in zip(s.state_shapes, s.state_dtypes)])
            elif s.kv_bits:  # quantised (quant.py): packed data, scales, biases per leaf
                self.keys.append(_quantized_zeros(s, slots, s.head_size))  # type: ignore[arg-type]
                self.values.append(_quantized_zeros(s, slots, s.head_size_v))  # type: ignore[arg-type]
                self.states.append(None)
            else:
                self.keys.append(mx.zeros((1, s.num_kv_heads, slots, s.head_size), DTYPES[s.dtype]))
                self.values.append(mx.zeros((1, s.num_kv_heads, slots, s.head_size_v), DTYPES[s.dtype]))
                self.states.append(None)
        mx.eval(self.arrays())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return ([a for leaf in self.keys + self.values if leaf is not None
                 for a in (leaf if isinstance(leaf, list) else (leaf,))]  # per step: no call per leaf
                + [a for st in self.states if st is not None for a in st])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """vLLM's kv_cache_block_copies: block dst becomes a copy of block src, in every layer
        (all sources are read before any destination is written)."""
        if not copies:
            return
        for i, spec in enumerate(self.specs):
            if self.states[i] is not None:  # a recurrent state slot per block id
                src_b = mx.array(np.asarray([c[0] for c in copies], np.int32))
                dst_b = mx.array(np.asarray([c[1] for c in copies], np.int32))
                for a in self.states[i]:
                    a[dst_b] = a[src_b]
                continue
            bs = spec.block_size
            within = np.arange(bs)
            src = mx.array(np.concatenate([c[0] * bs + within for c in copies]).astype(np.int32))
            dst = mx.array(np.concatenate([c[1] * bs + within for c in copies]).astype(np.int32))
            for a in _parts(self.keys[i]) + _parts(self.values[i]):  # head-major [1, H, slots, D]
                a[:, :, dst] = a[:, :, src]


def _quantized_zeros(spec: LayerSpec, slots: int, dim: int) -> list[mx.array]:
    """A quantised slot pool [1, H, slots, ...]: packed uint32 data, then a scale and a bias per group."""
    shape, groups = (1, spec.num_kv_heads, slots), dim // GROUP_SIZE
    return [mx.zeros((*shape, dim * spec.kv_bits // 32), mx.uint32),  # type: ignore[operator]
            mx.zeros((*shape, groups), DTYPES[spec.dtype]), mx.zeros((*shape, groups), DTYPES[spec.dtype])]


def _parts(leaf: mx.array | list[mx.array] | None) -> list[mx.array]:
    """A K or V leaf's arrays: none, one, or three (quantised: data, scales, biases)."""
    if leaf is None:
        return []
    return list(leaf) if isinstance(leaf, list) else [leaf]


@dataclass
class BatchLayout:
    """One padded batch [B, L]: row b computes positions starts[b] .. starts[b] + lengths[b] - 1.

    Row b reads keys at positions base[b] .. base[b] + K - 1 (past its context: the padding slot,
    masked). Full attention reads from 0; a sliding window or an attention chunk from the block
    holding the lowest position any of the row's queries can see, so blocks the scheduler freed
    once they left the window (vLLM replaces them with its null block) are never read.

    Built per step, so it holds only what every layer needs (the offsets, the write slots, the
    read plan) and plain per-row numbers; the position arrays a mask needs are made by `mask`,
    only for a step that needs one.
    """

    offsets: mx.array  # [B] start positions (RoPE offsets)
    reads: attention.SlotPlan  # [B, K] slots: a slice of the pool (one row, one run) or a gather
    writes: attention.SlotPlan  # [B, L] slots (padding queries: the padding slot): a slice or a scatter
    starts: Sequence[int]
    lengths: Sequence[int]
    base: Sequence[int]  # per row, the first position read
    # Every row has the same context and length: the read is cut to exactly the context and the
    # mask is None (decode) or "causal" (prefill), which lets SDPA take its unmasked/causal path.
    uniform: bool = False
    scalar_offset: int | None = None  # B == 1 and the model wants int offsets (llama4)
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, starts: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sink: int, *, window: int | None = None, chunk: int | None = None,
              scalar: bool = False) -> BatchLayout:
        bs, L = block_size, max(lengths)
        ctx = [s + n for s, n in zip(starts, lengths)]
        if scalar and chunk:  # exactly the keys llama4's own chunk mask covers: [start - chunk, end)
            base = [max(0, s - chunk) for s in starts]
        elif window:
            base = [max(0, s - window + 1) // bs * bs for s in starts]
        elif chunk:
            base = [s // chunk * chunk // bs * bs for s in starts]
        else:
            base = [0] * len(starts)
        K = max(c - b for c, b in zip(ctx, base))
        return cls(
            offsets=mx.array(starts, dtype=mx.int32), reads=attention.plan_reads(tables, base, ctx, K, bs, sink),
            writes=attention.plan_writes(tables, starts, lengths, bs, sink), starts=starts, lengths=lengths, base=base,
            uniform=all(c == ctx[0] for c in ctx) and all(n == L for n in lengths) and not any(base),
            scalar_offset=starts[0] if scalar and len(starts) == 1 else None,
        )

    @property
    def start_position(self) -> int:
        """The first position read (mlx-lm ChunkedKVCache.start_position)."""
        return self.base[0]

    @property
    def read_slots(self) -> mx.array:
        """[B, K] the slots read (materialised for an in-place read)."""
        return self.reads.slot_array()

    @property
    def key_pos(self) -> mx.array | None:
        """[B, K] positions of the keys read (None: 0 .. K-1 for every row)."""
        if not any(self.base):
            return None
        return mx.array(self.base, dtype=mx.int32)[:, None] + mx.arange(self.reads.length, dtype=mx.int32)

    def mask(self, window: int | None = None, return_array: bool = False, five_d: bool = False,
             chunk: int | None = None) -> mx.array | str | None:
        """[B, 1, L, K] bool ([B, 1, 1, L, K] for grouped 5-D scores). Padding queries see their
        row's first key, so no row is all-masked (its NaN would reach the padding slot)."""
        K, L = self.reads.length, max(self.lengths)
        if self.uniform and (window is None or window >= K) and not chunk and (L == 1 or not return_array):
            return None if L == 1 else "causal"
        key = (window, five_d, chunk)
        if key not in self._masks:
            key_pos = self.key_pos
            keys = (mx.arange(K, dtype=mx.int32)[None] if key_pos is None else key_pos)[:, None, :]
            q = (self.offsets[:, None] + mx.arange(L, dtype=mx.int32))[:, :, None]
            ctx = mx.array([s + n for s, n in zip(self.starts, self.lengths)], dtype=mx.int32)
            m = (keys <= q) & (keys < ctx[:, None, None])
            if window:
                m = m & (keys > q - window)
            if chunk:
                m = m & (keys >= (q // chunk) * chunk)
            if any(n != L for n in self.lengths):  # padding queries
                valid = mx.arange(L, dtype=mx.int32)[None] < mx.array(self.lengths, dtype=mx.int32)[:, None]
                m = m | (~valid[:, :, None] & (keys == keys[:, :, :1]))
            self._masks[key] = m[:, None, None] if five_d else m[:, None]
        return self._masks[key]


class PagedCache:
    """The mlx-lm cache contract over the block pool: `offset`, `update_and_fetch`, `make_mask`."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout, mask_5d: bool = False):
        self.pool, self.layer, self.layout, self.mask_5d = pool, layer, layout, mask_5d
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        spec = pool.specs[layer]
        self.window, self.chunk = spec.sliding_window, spec.attention_chunk_size

    @property
    def offset(self) -> mx.array | int:
        lay = self.layout
        return lay.offsets if lay.scalar_offset is None else lay.scalar_offset

    @property
    def start_position(self) -> int:
        return self.layout.start_position

    def maybe_trim_front(self) -> None:
        """ChunkedKVCache's API: the layout already reads only the keys the chunk can see."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, i, lay = self.pool, self.layer, self.layout
        pool.keys[i] = attention.write(pool.keys[i], lay.writes, keys)  # type: ignore[arg-type]
        pool.values[i] = attention.write(pool.values[i], lay.writes, values)  # type: ignore[arg-type]
        k = attention.read(pool.keys[i], lay.reads, keys.dtype)  # type: ignore[arg-type]
        v = attention.read(pool.values[i], lay.reads, values.dtype)  # type: ignore[arg-type]
        self.keys, self.values = k, v  # read (and reassigned) by deepseek_v32's indexer; the pool is the truth
        return k, v

    def keys_and_values(self) -> tuple[mx.array | None, mx.array | None]:
        """What this step's update_and_fetch returned (afm7's KV-reuse layers attend over it)."""
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        # A rotating cache holds `window` keys: a larger window asked by the model is cut to it.
        w = self.window if not window_size else min(window_size, self.window or window_size)
        return self.layout.mask(w, return_array, self.mask_5d, self.chunk)

    @property
    def state(self) -> list[mx.array]:
        return [self.pool.keys[self.layer], self.pool.values[self.layer]]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False
