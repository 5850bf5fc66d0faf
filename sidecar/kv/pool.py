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
    """One padded batch [B, L]: row b computes positions start[b] .. start[b] + n[b] - 1.

    Row b reads keys at positions base[b] .. base[b] + K - 1 (past its context: the padding slot,
    masked). Full attention reads from 0; a sliding window or an attention chunk from the block
    holding the lowest position any of the row's queries can see, so blocks the scheduler freed
    once they left the window (vLLM replaces them with its null block) are never read.
    """

    offsets: mx.array  # [B] start positions (RoPE offsets)
    write_slots: mx.array  # [B * L]
    reads: attention.ReadPlan  # [B, K] slots: a slice of the pool (one row, one run) or a gather
    query_pos: mx.array  # [B, L]
    ctx_lens: mx.array  # [B]
    key_pos: mx.array | None = None  # [B, K] positions of the keys read (None: 0 .. K-1)
    valid_q: mx.array | None = None  # [B, L] False for padding queries
    # Every row has the same context and length: the read is cut to exactly the context and the
    # mask is None (decode) or "causal" (prefill), which lets SDPA take its unmasked/causal path.
    uniform: bool = False
    scalar_offset: int | None = None  # B == 1 and the model wants int offsets (llama4)
    start_position: int = 0  # the first position read (mlx-lm ChunkedKVCache.start_position)
    write_start: int | None = None  # one row writing one run of slots: its first (a slice update)
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, starts: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sink: int, *, window: int | None = None, chunk: int | None = None,
              scalar: bool = False) -> BatchLayout:
        starts_np = np.asarray(starts, np.int64)
        n = np.asarray(lengths, np.int64)
        B, L = len(starts), int(n.max())
        ctx = starts_np + n
        nblk = int(-(-ctx.max() // block_size))
        table = np.zeros((B, nblk), np.int64)  # short tables pad with block 0: never read unmasked
        for b, t in enumerate(tables):
            k = min(len(t), nblk)
            table[b, :k] = t[:k]
        pos = starts_np[:, None] + np.arange(L)[None, :]
        valid = np.arange(L)[None, :] < n[:, None]
        blk = np.take_along_axis(table, np.minimum(pos // block_size, nblk - 1), axis=1)
        write = np.where(valid, blk * block_size + pos % block_size, sink)
        if scalar and chunk:  # exactly the keys llama4's own chunk mask covers: [start - chunk, end)
            base = np.maximum(0, starts_np - chunk)
        else:
            lo = np.zeros(B, np.int64)
            if window:
                lo = np.maximum(0, starts_np - window + 1)
            elif chunk:
                lo = (starts_np // chunk) * chunk
            base = (lo // block_size) * block_size
        K = int((ctx - base).max())
        kpos = base[:, None] + np.arange(K)[None, :]
        kblk = np.take_along_axis(table, np.minimum(kpos // block_size, nblk - 1), axis=1)
        read = np.where(kpos < ctx[:, None], kblk * block_size + kpos % block_size, sink)
        uniform = bool((ctx == ctx[0]).all() and (n == L).all() and not base.any())
        return cls(
            offsets=mx.array(starts_np.astype(np.int32)), write_slots=mx.array(write.reshape(-1).astype(np.int32)),
            reads=attention.plan_reads(read), query_pos=mx.array(pos.astype(np.int32)),
            ctx_lens=mx.array(ctx.astype(np.int32)), key_pos=mx.array(kpos.astype(np.int32)) if base.any() else None,
            valid_q=None if valid.all() else mx.array(valid), uniform=uniform,
            scalar_offset=int(starts_np[0]) if scalar and B == 1 else None, start_position=int(base[0]),
            write_start=int(write[0, 0]) if B == 1 and attention.is_run(write[0]) else None,
        )

    @property
    def read_slots(self) -> mx.array:
        """[B, K] the slots read (materialised for an in-place read)."""
        return self.reads.slot_array()

    def mask(self, window: int | None = None, return_array: bool = False, five_d: bool = False,
             chunk: int | None = None) -> mx.array | str | None:
        """[B, 1, L, K] bool ([B, 1, 1, L, K] for grouped 5-D scores). Padding queries see their
        row's first key, so no row is all-masked (its NaN would reach the padding slot)."""
        K, L = self.reads.length, self.query_pos.shape[1]
        if self.uniform and (window is None or window >= K) and not chunk and (L == 1 or not return_array):
            return None if L == 1 else "causal"
        key = (window, five_d, chunk)
        if key not in self._masks:
            keys = (mx.arange(K)[None] if self.key_pos is None else self.key_pos)[:, None, :]
            q = self.query_pos[:, :, None]
            m = (keys <= q) & (keys < self.ctx_lens[:, None, None])
            if window:
                m = m & (keys > q - window)
            if chunk:
                m = m & (keys >= (q // chunk) * chunk)
            if self.valid_q is not None:
                m = m | (~self.valid_q[:, :, None] & (keys == keys[:, :, :1]))
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
        pool.keys[i] = attention.write(pool.keys[i], lay.write_slots, keys, lay.write_start)  # type: ignore[arg-type]
        pool.values[i] = attention.write(pool.values[i], lay.write_slots, values, lay.write_start)  # type: ignore[arg-type]
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
