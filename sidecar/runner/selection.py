"""The final norm, made to keep only the positions whose logits a step needs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class Selection:
    index: mx.array | None = None
    hidden: mx.array | None = None  # the last decode forward's final-norm input (ahead.dispatch_early)


def select_before_norm(model: nn.Module) -> Selection | None:
    """Make the final norm keep only the selected flat positions (LM head cost ~ rows, not tokens).

    Swaps the norm instance's class for a subclass, so parameter names stay unchanged. Models
    without a `model.norm` fall back to slicing full logits.
    """
    norm = getattr(getattr(model, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        return None
    sel = Selection()
    base = type(norm)

    def __call__(self: nn.Module, h: mx.array) -> mx.array:
        sel.hidden = h if h.shape[-2] == 1 else None
        if sel.index is not None:
            h = h.reshape(-1, h.shape[-1])[sel.index][None]
        return base.__call__(self, h)

    norm.__class__ = type(f"Selecting{base.__name__}", (base,), {"__call__": __call__})
    return sel
