"""Quantised KV cache (`kv_dtype` 8bit / 4bit): the paged pool holds K/V as mlx-lm's QuantizedKVCache does.

Every K/V vector is quantised when it is written (`mx.quantize` over its last axis, group size 64:
packed uint32 data plus one scale and one bias per group, in the model's dtype) and attention reads
the quantised pool through mlx-lm's own quantised attention (`mlx_lm.models.base.
scaled_dot_product_attention` takes that path for a cache with `bits`). A pool leaf is then three
arrays, each head-major `[1, H, slots, n]` like an unquantised leaf, written and read by
attention.py's `write` / `read` one array at a time (one read plan, one gather index, for the three).

Semantics: quantised from the first token, as an mlx-lm `QuantizedKVCache` passed as the prompt
cache: every forward, prefill chunks included, attends over quantised K/V, so chunking, prefix
hits and preemption do not change a request's tokens. (mlx-lm's `generate(kv_bits=...)` converts
its cache only after the first prefill call, which therefore attends in full precision.)

Served quantised: attention layers whose head sizes the group size divides. Recurrent-state layers
stay unquantised (mlx-lm quantises only its KVCache layers). Sliding-window and chunked layers
(mlx-lm has no quantised rotating or chunked cache), MLA latents, other head sizes, and models whose
attention does not take mlx-lm's quantised cache are refused at load (400, field config.kv_dtype).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from sidecar.kv import attention
from sidecar.kv.pool import PagedCache
from sidecar.kv.spec import GROUP_SIZE, MLA, LayerSpec, UnsupportedModel

KV_BITS = {"8bit": 8, "4bit": 4}
FIELD = "config.kv_dtype"


def bits_of(kv_dtype: str | None) -> int | None:
    """8 or 4 for a quantised kv_dtype, else None."""
    return KV_BITS.get(kv_dtype or "")


def quantized(spec: LayerSpec, layer: int, bits: int) -> LayerSpec:
    """The attention leaf's spec served with `bits`; UnsupportedModel naming the layer when it cannot be."""
    why = None
    if spec.kind == MLA:
        why = "an MLA latent cache (mlx-lm has no quantised path for it)"
    elif spec.sliding_window:
        why = f"a sliding window of {spec.sliding_window} (mlx-lm has no quantised rotating cache)"
    elif spec.attention_chunk_size:
        why = f"chunked attention of {spec.attention_chunk_size} (mlx-lm has no quantised chunked cache)"
    elif spec.head_size % GROUP_SIZE or spec.head_size_v % GROUP_SIZE:
        why = f"head sizes {spec.head_size}/{spec.head_size_v}, not multiples of the group size {GROUP_SIZE}"
    if why:
        raise UnsupportedModel(f"kv_dtype {bits}bit: layer {layer} has {why}; use kv_dtype auto", field=FIELD)
    return replace(spec, kv_bits=bits)


def probe(model: Any, bits: int) -> None:
    """A prefill and a decode through mlx-lm's own QuantizedKVCache: a model whose attention does not
    take it (calls the fused kernel itself, attention sinks, ...) is refused here, not at a step."""
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, make_prompt_cache

    def swap(c: Any) -> Any:
        if isinstance(c, CacheList):
            c.caches = tuple(swap(x) for x in c.caches)
            return c
        return QuantizedKVCache(GROUP_SIZE, bits) if type(c) is KVCache else c

    caches = [swap(c) for c in make_prompt_cache(model)]
    try:
        for chunk in ([1, 2, 3, 4], [5]):
            mx.eval(model(mx.array([chunk]), cache=caches))
    except Exception as e:
        raise UnsupportedModel(f"kv_dtype {bits}bit: the model's attention does not take mlx-lm's quantised KV "
                               f"cache ({type(e).__name__}: {e})", field=FIELD) from None


class QuantizedPagedCache(PagedCache):
    """PagedCache over a quantised leaf: `update_and_fetch` returns (data, scales, biases) for K and
    for V, and `bits` / `group_size` route the model's attention to mlx-lm's quantised SDPA."""

    group_size = GROUP_SIZE

    def __init__(self, pool: Any, layer: int, layout: Any, mask_5d: bool = False):
        super().__init__(pool, layer, layout, mask_5d)
        self.bits = pool.specs[layer].kv_bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:  # type: ignore[override]
        pool, i, lay = self.pool, self.layer, self.layout
        out = []
        for store, new in ((pool.keys, keys), (pool.values, values)):
            q = mx.quantize(new, group_size=GROUP_SIZE, bits=self.bits)
            store[i] = [attention.write(a, lay.writes, x) for a, x in zip(store[i], q)]
            out.append(tuple(attention.read(a, lay.reads, a.dtype) for a in store[i]))
        self.keys, self.values = out
        return out[0], out[1]
