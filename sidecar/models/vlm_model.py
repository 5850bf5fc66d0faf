"""The runner's view of an mlx-vlm model (`VisionLanguageModel`): called like an mlx-lm model, with
the next call's input embeddings (and, for M-RoPE families, positions) bound beforehand by
engine/multimodal.py; each family (models/vlm_families.py) says what its encoder takes and runs it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from sidecar.errors import ProtocolError


class VisionLanguageModel(nn.Module):
    """mlx-vlm's model as the runner sees a text model; its vision tower runs through `encode`."""

    mrope = False  # positions from the request (bind) rather than from the cache offset
    rows_apart_past: int | None = None  # see ModelCaches.rows_apart_past (the paged cache's probe reads it)

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__()
        self.language_model = vlm.language_model  # logits_at selects rows inside its decoder
        self.family = config["model_type"]
        object.__setattr__(self, "_next", None)  # (embeddings, positions, visual) of the next call, from bind

    @property
    def decoder(self) -> nn.Module:
        """The module holding embed_tokens and layers (mlx-vlm nests it as `model`, or not)."""
        return self.language_model.get("model", self.language_model)

    @property
    def layers(self) -> list:
        return self.decoder.layers

    def make_cache(self) -> list:
        """mlx-lm's cache objects (what the paged cache probes) of the kinds mlx-vlm's model makes."""
        from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
        from mlx_vlm.models.cache import ArraysCache as StateCache

        own = getattr(self.language_model, "make_cache", None)
        if own is None:
            return [KVCache() for _ in self.layers]
        return [RotatingKVCache(max_size=c.max_size, keep=c.keep) if hasattr(c, "max_size")
                else ArraysCache(len(c.cache)) if isinstance(c, StateCache) else KVCache() for c in own()]

    def embed(self, ids: mx.array) -> mx.array:
        return self.decoder.embed_tokens(ids)

    def bind(self, embeds: mx.array | None, positions: mx.array | None,
             visual: tuple[np.ndarray, mx.array] | None = None) -> None:
        """`visual`: the flat batch positions [N] of the encoder rows merged into `embeds` and those
        rows' columns past the embedding width, for a family whose encoder gives more (deepstack)."""
        object.__setattr__(self, "_next", (embeds, positions, visual))

    def deepstack(self, visual: tuple[np.ndarray, mx.array] | None, shape: tuple[int, int]) -> dict:
        """The decoder's keyword arguments for the visual rows beyond the input embeddings (none here)."""
        return {}

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        embeds, positions, visual = self._next or (None, None, None)
        object.__setattr__(self, "_next", None)
        if not self.mrope:
            return self.language_model(inputs, inputs_embeds=embeds, cache=cache).logits
        if positions is None:  # text from the cache's offset on (the load-time probe)
            off = cache[0].offset if cache and isinstance(cache[0].offset, int) else 0
            B, L = inputs.shape
            positions = mx.broadcast_to(mx.arange(off, off + L)[None, None], (3, B, L))
        # The decoder and the head, as the language model's own __call__ ends: its position
        # bookkeeping before them reads the cache offset back from the device (a sync in the
        # middle of building every forward) to slice positions we give whole.
        lm = self.language_model
        h = lm.model(inputs, cache=cache, inputs_embeds=embeds, position_ids=positions,
                     **self.deepstack(visual, inputs.shape))
        return lm.model.embed_tokens.as_linear(h) if getattr(lm.args, "tie_word_embeddings", False) else lm.lm_head(h)

    image_token_id: int

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """The item's tensors are what this family's encoder takes (`tensors` False: only the
        metadata positions need, for an item the prefix cache covers)."""
        raise NotImplementedError

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        raise NotImplementedError

    def rope_positions(self, prompt: list[int], grids: list[np.ndarray]) -> tuple[np.ndarray, int]:
        raise NotImplementedError


def need(data: dict[str, np.ndarray], names: tuple[str, ...], family: str, path: str) -> list[np.ndarray]:
    """The named tensors of an item, or a 400 naming its `data` and what is missing."""
    missing = [n for n in names if n not in data]
    if missing:
        raise ProtocolError(f"{family} takes {', '.join(names)}; missing {', '.join(missing)}", field=f"{path}.data")
    return [data[n] for n in names]
