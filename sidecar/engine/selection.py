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

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn


class _Selected:
    """Stands in for `model.model` for one call: its output at the flat positions `index` (None:
    all), keeping the hidden states at `keep` (pooling requests' positions) in `kept`."""

    def __init__(self, inner: nn.Module, index: mx.array | None, keep: mx.array | None = None):
        self.inner, self.index, self.keep, self.used, self.kept = inner, index, keep, False, None

    def __getattr__(self, name: str) -> Any:  # embed_tokens (tied heads), args, ...
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        h = self.inner(*args, **kwargs)
        if isinstance(h, mx.array) and h.ndim == 3 and not self.used:
            self.used = True
            flat = h.reshape(-1, h.shape[-1])
            if self.keep is not None:
                self.kept = flat[self.keep]
            return h if self.index is None else flat[self.index][None]
        return h


def decoder(model: nn.Module) -> nn.Module | None:
    """The module whose output is the final hidden states (final norm included), if there is one."""
    owner = model if "model" in model else model.get("language_model")
    inner = owner.get("model") if isinstance(owner, nn.Module) else None
    return inner if isinstance(inner, nn.Module) else None


def forward_at(model: nn.Module, tokens: mx.array, cache: list, index: mx.array | None,
               keep: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """The model's logits [len(index), V] at the flat positions `index` of tokens [B, L] (None:
    all), and its final hidden states [len(keep), D] at the flat positions `keep` (None: none)."""
    owner = model if "model" in model else model.get("language_model")
    inner = decoder(model) if index is not None or keep is not None else None
    sel = _Selected(inner, index, keep) if inner is not None else None
    if sel is not None:
        object.__setattr__(owner, "model", sel)  # an instance attribute over the module's own entry
    try:
        out = model(tokens, cache=cache)
    finally:
        if sel is not None:
            object.__delattr__(owner, "model")
    out = out.reshape(-1, out.shape[-1])
    logits = out if index is None or (sel is not None and sel.used) else out[index]
    return logits, sel.kept if sel is not None else None


def logits_at(model: nn.Module, tokens: mx.array, cache: list, index: mx.array | None) -> mx.array:
    """The model's logits [len(index), V] at the flat positions `index` of tokens [B, L] (None: all)."""
    return forward_at(model, tokens, cache, index)[0]


@dataclass
class Selected:
    """The flat positions of a padded batch [B, L] whose logits a step needs."""

    index: mx.array | None  # None: every position (a batch of decodes), no gather
    last_at: list[int]  # per row, where its last position's logits (then its drafts') start
    spans: list[tuple[int, int, int, list[int]]]  # prompt logprobs: (row, first, count, target ids)


def selected(rows: Sequence[Any], lengths: Sequence[int]) -> Selected:
    """Each row's last position and its drafts', after its prompt-logprob positions if it asks for them."""
    L = max(lengths)
    select: list[int] = []
    last_at: list[int] = []
    spans: list[tuple[int, int, int, list[int]]] = []
    for b, r in enumerate(rows):
        P = len(r.state.prompt_token_ids)
        hi = min(r.end, P - 1)
        if r.state.sampling_params.prompt_logprobs is not None and hi > r.start:
            spans.append((b, len(select), hi - r.start, r.state.prompt_token_ids[r.start + 1 : hi + 1]))
            select.extend(b * L + i for i in range(hi - r.start))
        last_at.append(len(select))
        select.extend(b * L + lengths[b] - 1 - j for j in range(r.num_draft, -1, -1))
    index = None if len(select) == len(rows) * L else mx.array(select, dtype=mx.int32)
    return Selected(index, last_at, spans)
