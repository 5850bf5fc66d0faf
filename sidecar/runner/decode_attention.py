"""A decode step's attention (mlx-lm llama, qwen2, qwen3 `Attention`) without layout-only graph nodes, on the CPU backend.

At one query position, mlx-lm's `reshape(B, 1, H, D).transpose(0, 2, 1, 3)` of q, k and v, and the
output's `transpose(0, 2, 1, 3).reshape(B, 1, -1)`, move nothing: each is one `reshape`. And the
CPU fallback of `mx.fast.scaled_dot_product_attention` for grouped heads unflattens q to
`[B, Hkv, rep, 1, D]`, expands and broadcasts k and v per repeat, and flattens the output back:
with one query position the `rep` query heads of a KV head are simply `rep` rows of one matmul
against that head's keys, `[B, Hkv, rep, D] @ [B, Hkv, D, K]`, the same dot products with no
broadcast. Together ~19 nodes per layer become ~10, each node one dispatch on the MLX thread.
The arithmetic is the fallback's (scale times q, the same mask rule, precise softmax); grouping
the rows into one matmul may round the dot products differently in the last bit (within 1e-6;
greedy tokens equal mlx-lm's: tests/runner/test_decode_attention.py).

Only one-position calls over the paged cache (or inside the compiled decode forward,
decode_compiled.py) with a per-row mask (or none) take this path, and not a quantised KV cache;
every other call (prefill, other caches, other families) is the module's own code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from sidecar.runner.decode_compiled import TraceCache
from sidecar.runner.kv_cache import PagedCache

_CACHES = (PagedCache, TraceCache)  # (not QuantizedPagedCache, a subclass)


def _decode_call(self: Any, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    B, L, _ = x.shape
    if (L != 1 or type(cache) not in _CACHES or hasattr(cache, "bits") or isinstance(mask, str)
            or (mask is not None and (mask.ndim != 4 or mask.shape[1] != 1))):
        return None
    offset = cache.offset
    if not isinstance(offset, mx.array):
        return None
    Hq, Hkv = self.n_heads, self.n_kv_heads
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if hasattr(self, "q_norm"):  # qwen3: a per-head norm before RoPE
        q = self.q_norm(q.reshape(B, 1, Hq, -1)).reshape(B, Hq, 1, -1)
        k = self.k_norm(k.reshape(B, 1, Hkv, -1)).reshape(B, Hkv, 1, -1)
    else:
        q, k = q.reshape(B, Hq, 1, -1), k.reshape(B, Hkv, 1, -1)
    v = v.reshape(B, Hkv, 1, -1)
    q = self.rope(q, offset=offset)
    k = self.rope(k, offset=offset)
    k, v = cache.update_and_fetch(k, v)
    dtype = mx.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    q = (mx.array(self.scale, dtype) * q).reshape(B, Hkv, Hq // Hkv, -1)  # [B, Hkv, rep, D]
    scores = q @ k.swapaxes(-1, -2)  # [B, Hkv, rep, K]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v  # [B, Hkv, rep, D]
    return self.o_proj(out.reshape(B, 1, -1))


def _swap_for(base: type) -> type:
    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        out = _decode_call(self, x, mask, cache)
        return base.__call__(self, x, mask=mask, cache=cache) if out is None else out

    return type(f"Decode{base.__module__.rsplit('.', 1)[-1].title()}Attention", (base,), {"__call__": __call__})


def attention_swaps() -> dict[type, type]:
    from mlx_lm.models import llama, qwen2, qwen3

    return {base: _swap_for(base) for base in (llama.Attention, qwen2.Attention, qwen3.Attention)}


ATTENTION_SWAPS: dict[type, type] = attention_swaps()
