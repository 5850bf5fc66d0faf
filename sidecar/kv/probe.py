"""What each layer of a model caches, measured from the model itself.

`derive` builds the model's own mlx-lm caches (`make_cache()`, else one KVCache per layer), runs
one probe forward of a few tokens and a one-token decode through them, and reads what each cache
holds: K/V head counts and sizes (so naming variants, MLA latents and K/V of different head sizes
need no config reading), the window of a rotating cache, the chunk of a chunked cache, and the
per-request state shapes of recurrent layers. Any other cache type is refused with the layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sidecar.kv import quant as kv_quant
from sidecar.kv.pool import dtype_name
from sidecar.kv.spec import ATTENTION, DTYPE_BYTES, MLA, STATE, LayerSpec, ModelCaches, UnsupportedModel


def _leaves(caches: list[Any]) -> tuple[list[tuple[int, int | None, Any]], list[int | tuple[int, ...]]]:
    from mlx_lm.models.cache import CacheList

    leaves: list[tuple[int, int | None, Any]] = []
    structure: list[int | tuple[int, ...]] = []
    for i, c in enumerate(caches):
        if isinstance(c, CacheList):
            idx = []
            for k, sub in enumerate(c.caches):
                if isinstance(sub, CacheList):
                    raise UnsupportedModel(f"layer {i}: nested CacheList caches are not supported", field="model")
                idx.append(len(leaves))
                leaves.append((i, k, sub))
            structure.append(tuple(idx))
        else:
            structure.append(len(leaves))
            leaves.append((i, None, c))
    return leaves, structure


def _model_arg(model: Any, name: str) -> Any:
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        if a is None:
            continue
        v = a.get(name) if isinstance(a, dict) else getattr(a, name, None)
        if v is not None:
            return v
    return None


def _has_grouped_scores(model: Any) -> bool:
    """gemma2-style attention reshapes queries to [B, kv_heads, repeats, L, D] and applies the
    mask to those 5-D scores, so a [B, 1, L, K] mask would broadcast over the wrong axes."""
    for _, m in model.named_modules():
        if isinstance(getattr(m, "repeats", None), int) and m.repeats > 1 and hasattr(m, "attn_logit_softcapping"):
            return True
    return False


# Families refused before any forward. plamo3's mlx-lm output depends on mlx-lm's own prefill
# chunking (its sliding layers mask window + 1 keys over a rotating cache of window), so no paged
# cache reproduces it; phi3small's block-sparse attention crashes the process (a segfault inside
# MLX on the CPU backend, in mlx-lm's own forward of a few tokens).
_REFUSED = {"plamo3": "sliding layers mask a window one wider than their rotating cache holds",
            "phi3small": "its block-sparse attention crashes MLX (segfault) on short sequences"}
# Families that place queries by how many keys the cache returned (minimax_m3's block indexer:
# `qpos = arange(S - L, S)`), which a padded batch's read length moves: one row at a time. The
# load probe's short prompts select every block, so it cannot see this.
_KEY_COUNT_POSITIONS = {"minimax_m3_vl"}


# Why mlx-lm's own forward fails on this backend, for the probe's 400.
_PROBE_HINTS = {
    "GatherMM": "MLX's CPU backend runs unquantized mixture-of-experts matmuls in float32 only: "
                "serve a float32 checkpoint, or one whose experts are quantized",
    "No Metal back-end": "mlx-lm's forward calls a Metal-only kernel: it runs on Apple silicon only",
}


def derive(model: Any, block_size: int, kv_dtype: str | None = None) -> ModelCaches:
    """Probe the model's own caches; raises UnsupportedModel naming the layer and its cache kind."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family in _REFUSED:
        raise UnsupportedModel(f"{family}: {_REFUSED[family]}", field="model")
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    leaves, structure = _leaves(list(caches))
    for i, k, c in leaves:
        if type(c) not in (KVCache, RotatingKVCache, ChunkedKVCache) and not isinstance(c, ArraysCache):
            raise UnsupportedModel(f"layer {i}: cache kind {type(c).__name__} is not supported by the paged cache",
                                   field="model")
        if isinstance(c, RotatingKVCache) and c.keep:
            raise UnsupportedModel(f"layer {i}: a rotating cache that keeps {c.keep} sink tokens is not supported",
                                   field="model")
    # One token, four, one: a state's shape must not depend on how many tokens it has seen.
    chunks = [[1], [2, 3, 4, 5], [6]]
    shapes_seen = []
    try:
        for chunk in chunks:
            mx.eval(model(mx.array([chunk]), cache=caches))
            shapes_seen.append([[None if a is None else a.shape for a in c.cache] if isinstance(c, ArraysCache) else None
                                for _, _, c in leaves])
    except Exception as e:  # a model mlx-lm itself cannot run: refuse rather than fail later
        hint = next((f" ({h})" for k, h in _PROBE_HINTS.items() if k in str(e)), "")
        raise UnsupportedModel(f"the model's own probe forward failed: {type(e).__name__}: {e}{hint}",
                               field="model") from None

    bits = kv_quant.bits_of(kv_dtype)
    lora = _model_arg(model, "kv_lora_rank")
    specs: list[LayerSpec] = []
    state_entries: dict[int, tuple[int, tuple[int, ...]]] = {}
    counts: dict[tuple[int, str], int] = {}
    for j, (i, k, c) in enumerate(leaves):
        if isinstance(c, ArraysCache):
            used = tuple(e for e, a in enumerate(c.cache) if a is not None)
            if not used:
                raise UnsupportedModel(f"layer {i}: its recurrent state was never written by a forward", field="model")
            shapes = tuple(tuple(c.cache[e].shape[1:]) for e in used)
            if any(seen[j] != shapes_seen[-1][j] for seen in shapes_seen):
                raise UnsupportedModel(f"layer {i}: recurrent state whose shape grows with the sequence", field="model")
            odd = [str(c.cache[e].dtype) for e in used if c.cache[e].dtype not in (mx.float16, mx.bfloat16, mx.float32)]
            if odd:  # e.g. token ids: not a recurrent state the pool can hold
                raise UnsupportedModel(f"layer {i}: a recurrent state of dtype {odd[0]} is not supported",
                                       field="model")
            state_entries[j] = (len(c.cache), used)
            spec = LayerSpec(block_size, 0, 0, 0, dtype_name(c.cache[used[0]].dtype), kind=STATE,
                             state_shapes=shapes, state_dtypes=tuple(dtype_name(c.cache[e].dtype) for e in used))
        else:
            if c.keys is None or c.offset != sum(map(len, chunks)):
                raise UnsupportedModel(f"layer {i}: its cache is not written once per token by a forward "
                                       f"(shared or skipped KV layers are not supported)", field="model")
            _, H, _, D = c.keys.shape
            Dv = c.values.shape[-1]
            dtype = kv_dtype if kv_dtype in DTYPE_BYTES else dtype_name(c.keys.dtype)
            kind = MLA if lora and H == 1 and D == lora else ATTENTION
            window = c.max_size if isinstance(c, RotatingKVCache) else None
            chunk = c.chunk_size if isinstance(c, ChunkedKVCache) else None
            spec = LayerSpec(block_size, H, D, Dv, dtype, window, kind, chunk)
            if bits:
                spec = kv_quant.quantized(spec, i, bits)
        role = "mixer" if spec.kind == STATE else "self_attn"
        counts[(i, role)] = counts.get((i, role), 0) + 1
        specs.append(spec)
    # Names: model.layers.{i}.self_attn / .mixer, suffixed when one layer has several of a role.
    seen: dict[tuple[int, str], int] = {}
    for j, (i, k, c) in enumerate(leaves):
        role = "mixer" if specs[j].kind == STATE else "self_attn"
        n = seen.get((i, role), 0)
        seen[(i, role)] = n + 1
        name = f"model.layers.{i}.{role}" + (f".{n}" if counts[(i, role)] > 1 else "")
        specs[j] = _named(specs[j], name)
    if bits:
        kv_quant.probe(model, bits)
    return ModelCaches(
        specs, structure, [c for _, _, c in leaves], state_entries,
        scalar_offsets=family in _KEY_COUNT_POSITIONS or any(isinstance(c, ChunkedKVCache) for _, _, c in leaves),
        rows_apart_past=getattr(model, "rows_apart_past", None),
        mask_5d=_has_grouped_scores(model),
    )


def _named(spec: LayerSpec, name: str) -> LayerSpec:
    return replace(spec, name=name)
