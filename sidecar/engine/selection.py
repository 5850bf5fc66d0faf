"""Logits only where a step needs them: hidden states selected before the LM head.

vLLM's runner computes `compute_logits(hidden_states[logits_indices])`. mlx-lm's models end their
`__call__` the same way: `self.model(...)` (the decoder, final norm included), then the family's
own head (an `lm_head`, tied `embed_tokens.as_linear`, soft-capping, a logit scale...). So the
model's `__call__` runs unchanged while, for that one call, `model.model` answers with the selected
positions of its output: the head computes only those rows (its cost ~ rows, not tokens). A
multimodal wrapper's text model (`language_model`) is the one whose decoder stands in. A model
without a decoder module there, or whose decoder output is not [B, L, D], gives full logits,
selected after: the same logits, by one generic path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _Selected:
    """Stands in for `model.model` for one call: its output at the flat positions `index`."""

    def __init__(self, inner: nn.Module, index: mx.array):
        self.inner, self.index, self.used = inner, index, False

    def __getattr__(self, name: str) -> Any:  # embed_tokens (tied heads), args, ...
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        h = self.inner(*args, **kwargs)
        if isinstance(h, mx.array) and h.ndim == 3 and not self.used:
            self.used = True
            return h.reshape(-1, h.shape[-1])[self.index][None]
        return h


def logits_at(model: nn.Module, tokens: mx.array, cache: list, index: mx.array | None) -> mx.array:
    """The model's logits [len(index), V] at the flat positions `index` of tokens [B, L] (None: all)."""
    owner = model if "model" in model else model.get("language_model")
    inner = owner.get("model") if isinstance(owner, nn.Module) and index is not None else None
    sel = _Selected(inner, index) if isinstance(inner, nn.Module) else None  # type: ignore[arg-type]
    if sel is not None:
        object.__setattr__(owner, "model", sel)  # an instance attribute over the module's own entry
    try:
        out = model(tokens, cache=cache)
    finally:
        if sel is not None:
            object.__delattr__(owner, "model")
    out = out.reshape(-1, out.shape[-1])
    return out if index is None or (sel is not None and sel.used) else out[index]
