"""Pooling requests: embeddings and classification from the model's final hidden states.

As vLLM's pooler: the decoder's output (final norm included) at a request's positions is pooled
(LAST: its last prompt token, CLS: its first, MEAN: all, ALL: one vector per token), then the head
runs: for embeddings Matryoshka truncation to `dimensions` and L2 normalisation; for
classification the `score` layer of a *ForSequenceClassification checkpoint and sigmoid (one
label) or softmax. The runner's forward keeps the hidden states of the positions `positions` names
(selection.py); `collect` folds each chunk into its request (a float32 running sum for MEAN, so a
prompt chunked across steps pools exactly as a whole one), and the step that computes a request's
last prompt token returns its result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from sidecar.engine.selection import decoder
from sidecar.engine.state import Row
from sidecar.errors import ProtocolError
from sidecar.kv.spec import UnsupportedModel
from sidecar.wire.pooling_params import PoolingModel, PoolingParams

# Bidirectional encoders: no mlx-lm module, and no causal paged cache could serve them.
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert", "electra",
                      "modernbert", "nomic_bert", "new", "gte"})
# sentence-transformers' 1_Pooling/config.json flags -> vLLM's pooling types
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def is_classifier(config: dict) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def num_labels(config: dict) -> int:
    """transformers' rule: `num_labels`, else the size of `id2label`, else 2."""
    if config.get("num_labels"):
        return int(config["num_labels"])
    return len(config.get("id2label") or {}) or 2


def _classifier_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's model class with the checkpoint's `score` head beside the decoder. Such a
    checkpoint ships no LM head; the model never samples, so an untied one is a 1-row stand-in."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    hidden, labels = int(_text_config(config)["hidden_size"]), num_labels(config)

    class ForSequenceClassification(model_class):  # type: ignore[misc,valid-type]
        def __init__(self, args: Any):
            super().__init__(args)
            self.score = nn.Linear(hidden, labels, bias=False)
            if "lm_head" in self:
                self.lm_head = nn.Linear(hidden, 1, bias=False)

        def sanitize(self, weights: dict) -> dict:
            weights = super().sanitize(weights) if hasattr(super(), "sanitize") else weights
            if "lm_head" in self:
                like = weights["score.weight"]
                weights["lm_head.weight"] = mx.zeros((1, hidden), like.dtype if like.dtype != mx.uint32 else mx.float16)
            return weights

    return ForSequenceClassification, args_class


def load(path: Path, lazy: bool = False) -> tuple[nn.Module, dict]:
    """mlx-lm's load_model, with a *ForSequenceClassification checkpoint's head loaded too."""
    from mlx_lm.utils import load_model

    config = json.loads((Path(path) / "config.json").read_text())
    if str(config.get("model_type", "")).lower() in ENCODERS:
        raise UnsupportedModel(f"{config['model_type']} is an encoder-only (bidirectional) model: the sidecar serves "
                               "decoder models (an embedding model converted from one, e.g. Qwen3-Embedding)",
                               field="config.model")
    if is_classifier(config):
        return load_model(Path(path), lazy=lazy, get_model_classes=_classifier_classes)
    return load_model(Path(path), lazy=lazy)


def _st_pooling(path: Path) -> str | None:
    """The pooling type a sentence-transformers directory declares (modules.json's Pooling module)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
        sub = next(m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling"))
        flags = json.loads((path / sub / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    return next((kind for key, kind in _ST_MODES.items() if flags.get(key)), None)


def _st_dense(path: Path) -> bool:
    try:
        return any(str(m.get("type", "")).endswith("Dense") for m in json.loads((path / "modules.json").read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def pooling_model(model: nn.Module, config: dict, path: Path, runner: str) -> PoolingModel | None:
    """What the model offers for pooling requests (None: generation only). `runner` auto offers it
    where the directory declares an embedding (sentence-transformers) or classification model;
    pooling offers it for any decoder (vLLM's --convert embed); generate never."""
    head = model.get("score") if "score" in model else None
    declared = head is not None or (path / "modules.json").is_file()
    if runner == "generate" or (runner == "auto" and not declared):
        return None
    if _st_dense(path):
        raise ProtocolError("the model directory's sentence-transformers Dense projection is not applied by the "
                            "sidecar (its embeddings would differ from the model's)", field="config.model")
    if decoder(model) is None:
        raise ProtocolError("pooling needs the model's final hidden states, and this model has no decoder module "
                            "at model.model (encoder-only models are not served)", field="config.runner")
    labels = head.weight.shape[0] if head is not None else 0
    return PoolingModel(int(_text_config(config)["hidden_size"]), _st_pooling(path) or "LAST", labels,
                        classify_only=head is not None)


def positions(rows: list[Row], lengths: list[int], L: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Flat positions (into a [B, L] batch) whose hidden states the batch's pooling rows need, and
    per such row (row, first index into them, count)."""
    keep: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for b, r in enumerate(rows):
        p = r.state.pooling_params
        if p is None:
            continue
        kind, n = p.pooling_type, lengths[b]
        if kind == "LAST":
            idx = [n - 1] if r.end == len(r.state.prompt_token_ids) else []
        elif kind == "CLS":
            idx = [0] if r.start == 0 else []
        else:  # MEAN, ALL
            idx = list(range(n))
        spans.append((b, len(keep), len(idx)))
        keep.extend(b * L + i for i in idx)
    return keep, spans


def collect(hidden: mx.array | None, spans: list[tuple[int, int, int]], where: list[int], parts: dict) -> None:
    """Each pooling row's share of the batch's kept hidden states, by its index in the step (lazy)."""
    for b, first, count in spans:
        parts[where[b]] = hidden[first : first + count] if count else None  # type: ignore[index]


def finish(rows: list[Row], parts: dict, model: nn.Module) -> list | None:
    """Fold this step's hidden states into each pooling request; the results of the requests whose
    last prompt token ran (None for the others; None as a whole without pooling rows)."""
    if not any(r.state.pooling_params is not None for r in rows):
        return None
    done: dict[int, mx.array] = {}
    for i, r in enumerate(rows):
        s, p = r.state, r.state.pooling_params
        if p is None:
            continue
        if r.start == 0:  # a first chunk, or a recomputation after preemption: start over
            s.pooled, s.pooled_upto = None, 0
        h = parts.get(i)
        if h is not None:
            h = h.astype(mx.float32)
            if p.pooling_type == "MEAN":
                h = h.sum(axis=0)
                s.pooled = h if s.pooled is None else s.pooled + h
            elif p.pooling_type == "ALL":
                s.pooled = h if s.pooled is None else mx.concatenate([s.pooled, h])  # type: ignore[list-item]
            else:
                s.pooled = h[0]
        s.pooled_upto = r.end
        if r.end == len(s.prompt_token_ids):
            pooled = s.pooled / r.end if p.pooling_type == "MEAN" else s.pooled
            done[i] = head(pooled, p, model)  # type: ignore[arg-type]
        elif s.pooled is not None:
            mx.eval(s.pooled)  # a chunk's sum, not its graph, waits for the next chunk
    mx.eval(list(done.values()))
    return [done[i].tolist() if i in done else None for i in range(len(rows))]


def head(pooled: mx.array, p: PoolingParams, model: nn.Module) -> mx.array:
    """vLLM's pooler heads on pooled float32 hidden states [D] or [T, D]."""
    if p.classify:
        score = model["score"]
        logits = score(pooled.astype(score.weight.dtype) if score.weight.dtype != mx.uint32 else pooled)
        logits = logits.astype(mx.float32)
        if not p.use_activation:
            return logits
        return mx.sigmoid(logits) if logits.shape[-1] == 1 else mx.softmax(logits, axis=-1, precise=True)
    if p.dimensions is not None:
        pooled = pooled[..., : p.dimensions]
    if p.use_activation:  # F.normalize: x / max(||x||, 1e-12)
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled
