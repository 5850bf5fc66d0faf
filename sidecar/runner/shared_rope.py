"""One decode step's RoPE angles, computed once and shared by every q and k call of every layer.

`mx.fast.rope`'s CPU fallback rebuilds positions, frequencies, cos and sin on every call (7 of the
12 nodes a compiled decode call still has), though all layers' q and k rotate by the same offsets
array in a step. Here the first call of a step applies the module's own (compiled) RoPE to a probe
`[B, 1, 1, dims]` whose rotated halves are ones and zeros: its output is exactly the `cos` and
`sin` the fallback multiplies by (already in the input's dtype: `1 * c - 0 * s == c`). Every call
then only rotates: two slices, two fused kernels and a concatenate, the fallback's own arithmetic
in its own order, so the result is bit for bit `mx.fast.rope`'s (tests/runner/test_shared_rope.py).

The memo holds the last offsets array per RoPE shape and dtype and matches it by identity: a new
step's layout brings a new array, so nothing from an older step is reused.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mlx.core as mx

_memo: dict[tuple, tuple[mx.array, mx.array, mx.array]] = {}


@functools.lru_cache(maxsize=64)
def _probe(dims: int, traditional: bool, dtype: mx.Dtype, B: int) -> mx.array:
    half = dims // 2
    one = mx.array([1.0, 0.0] * half) if traditional else mx.concatenate([mx.ones(half), mx.zeros(half)])
    p = mx.broadcast_to(one.astype(dtype), (B, 1, 1, dims))
    p = mx.contiguous(p)
    mx.eval(p)
    return p


@functools.lru_cache(maxsize=None)
def _rotate(dims: int, traditional: bool) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    def rotate(x: mx.array, c: mx.array, s: mx.array) -> mx.array:
        B, N, T, D = x.shape
        if traditional:
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:
            x1, x2 = x[..., : dims // 2], x[..., dims // 2 : dims]
        outs = [x1 * c - x2 * s, x1 * s + x2 * c]
        if traditional:
            out = mx.concatenate([o[..., None] for o in outs], -1).reshape(B, N, T, dims)
            return out if dims == D else mx.concatenate([out, x[..., dims:]], -1)
        if dims < D:
            outs.append(x[..., dims:])
        return mx.concatenate(outs, -1)

    return mx.compile(rotate)


def forget() -> None:
    _memo.clear()


def shared_rope(x: mx.array, offset: mx.array, key: tuple, rope: Callable[[mx.array], mx.array]) -> mx.array:
    """x [B, H, 1, D] rotated by offset [B] (or [1]); `key` names the RoPE (dims, traditional, base,
    scale, frequencies) and `rope(probe)` applies it. Shares cos/sin with the step's other calls."""
    dims, traditional = key[0], key[1]
    k = (*key, x.dtype, x.shape[0])
    hit: Any = _memo.get(k)
    if hit is None or hit[0] is not offset:
        out = rope(_probe(dims, traditional, x.dtype, x.shape[0]))
        if traditional:
            c, s = out[..., 0::2], out[..., 1::2]
        else:
            c, s = out[..., : dims // 2], out[..., dims // 2 :]
        hit = _memo[k] = (offset, c, s)
    return _rotate(dims, traditional)(x, hit[1], hit[2])
