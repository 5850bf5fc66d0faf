"""What each layer caches (vLLM's KVCacheSpec per cache leaf), its page size, and a model's KV cache groups.

Plain data, no MLX: probe.py measures these from the model, pool.py allocates the pool from
them, quant.py serves quantised leaves.

Layers are "leaves": one per mlx-lm cache object, a `CacheList` giving several leaves to one layer.
`structure` records how leaves nest so the runner rebuilds the model's cache list from adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from sidecar.errors import ProtocolError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
ATTENTION, MLA, STATE = "attention", "mla", "state"
GROUP_SIZE = 64  # quantised K/V: values per scale and bias (mlx-lm's kv_group_size default)


class UnsupportedModel(ProtocolError):
    """The model has a layer the paged cache cannot serve (400 at load_model, naming the layer kind)."""


@dataclass(frozen=True)
class LayerSpec:
    """vLLM's KVCacheSpec for one cache leaf (an attention layer or a recurrent layer's state)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    sliding_window: int | None = None
    kind: str = ATTENTION  # attention | mla | state
    attention_chunk_size: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()  # state: per request, one per state array
    state_dtypes: tuple[str, ...] = ()
    name: str = ""
    kv_bits: int | None = None  # quantised K/V (kv_dtype 8bit/4bit: quant.py); dtype is then the scales'

    @property
    def type(self) -> str:
        if self.kind == STATE:
            return "mamba"
        if self.kind == MLA:
            return "mla_attention"
        if self.attention_chunk_size:
            return "chunked_local_attention"
        return "sliding_window" if self.sliding_window else "full_attention"

    @property
    def group_key(self) -> tuple:
        """Layers with equal keys share a KV cache group (one block table per request)."""
        return (self.type, self.sliding_window, self.attention_chunk_size)

    @property
    def page_size_bytes(self) -> int:
        if self.kind == STATE:
            return sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(self.state_shapes, self.state_dtypes))
        if self.kv_bits:  # per vector: packed data, then a scale and a bias per group, in `dtype`
            per_head = sum(d * self.kv_bits // 8 + 2 * (d // GROUP_SIZE) * DTYPE_BYTES[self.dtype]
                           for d in (self.head_size, self.head_size_v))
            return self.block_size * self.num_kv_heads * per_head
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * DTYPE_BYTES[self.dtype]

    def to_wire(self) -> dict:
        d: dict[str, Any] = {
            "type": self.type, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size, "head_size_v": self.head_size_v, "dtype": self.dtype,
            "sliding_window": self.sliding_window, "page_size_bytes": self.page_size_bytes,
        }
        if self.kind == MLA:  # vLLM's MLAAttentionSpec: one latent head of kv_lora_rank + qk_rope_head_dim
            d.update(head_size=self.head_size + self.head_size_v, head_size_v=0,
                     kv_lora_rank=self.head_size, qk_rope_head_dim=self.head_size_v)
        if self.attention_chunk_size:
            d["attention_chunk_size"] = self.attention_chunk_size
        if self.kv_bits:  # stored as mlx-lm's QuantizedKVCache (docs/protocol.md, quantised KV cache)
            d["kv_quantization"] = {"bits": self.kv_bits, "group_size": GROUP_SIZE}
        if self.kind == STATE:  # vLLM's MambaSpec: one state slot per request, no prefix caching
            d.update(num_kv_heads=0, head_size=0, head_size_v=0, shapes=[list(s) for s in self.state_shapes],
                     dtypes=list(self.state_dtypes), prefix_caching=False)
        return d


@dataclass
class ModelCaches:
    """A model's cache leaves and how they nest into the cache list its forward takes."""

    specs: list[LayerSpec]
    structure: list[int | tuple[int, ...]]  # per model cache entry: a leaf index, or a CacheList's leaves
    templates: list[Any] = field(default_factory=list)  # per leaf: the probed mlx-lm cache (state leaves copy it)
    state_entries: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # leaf -> (size, used)
    scalar_offsets: bool = False  # the model needs int offsets (llama4's chunk mask): rows run one at a time
    # a decoder that scales a whole batch's attention by its first row's positions from here on:
    # a batch reaching this position runs one row at a time
    rows_apart_past: int | None = None
    mask_5d: bool = False  # grouped-query scores [B, kv, rep, L, K] (gemma2): masks get an extra axis

    @property
    def has_state(self) -> bool:
        return any(s.kind == STATE for s in self.specs)

    def groups(self) -> list[list[int]]:
        """Leaf indices per KV cache group, in order of first appearance."""
        out: dict[tuple, list[int]] = {}
        for i, s in enumerate(self.specs):
            out.setdefault(s.group_key, []).append(i)
        return list(out.values())


def spec_wire(specs: Sequence[LayerSpec]) -> dict[str, dict]:
    return {s.name: s.to_wire() for s in specs}
