"""PoolingParams: the wire type of a pooling request's settings (vLLM v1 names) and its validation.

A request carries `pooling_params` instead of `sampling_params`: its prompt is prefilled like any
other and the step computing its last prompt token returns its pooled result (`pooler_output`).
What depends on the model (is it a pooling model, its hidden size, a classification head) is
checked by the planner. MLX-free, like the rest of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.errors import ProtocolError
from sidecar.wire.codec import wire_type

TASKS = ("embed", "classify", "token_embed", "token_classify")
SEQ_POOLING = ("LAST", "MEAN", "CLS")  # one vector per request (vLLM's seq_pooling_type)
TOKEN_POOLING = ("ALL",)  # one vector per prompt token (vLLM's tok_pooling_type)


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    pooling_type: str | None = None  # None: the model's own (sentence-transformers config, else LAST)
    dimensions: int | None = None  # Matryoshka: keep the first d, then normalise
    use_activation: bool = True  # embed: L2-normalise; classify: sigmoid (1 label) or softmax

    @property
    def per_token(self) -> bool:
        return self.task.startswith("token_")

    @property
    def classify(self) -> bool:
        return self.task.endswith("classify")

    @classmethod
    def from_wire(cls, d: Any, *, path: str) -> PoolingParams:
        """Validate a map with vLLM's field names; unknown fields (vLLM's internal ones such as
        `skip_reading_prefix_cache`, `requires_token_ids`) are ignored."""
        if not isinstance(d, dict):
            raise ProtocolError(f"pooling_params must be a map, got {wire_type(d)}", field=path)
        task = d.get("task") or "embed"
        if task not in TASKS:
            raise ProtocolError(f"unknown pooling task {task!r} (known: {', '.join(TASKS)})", field=f"{path}.task")
        kind = d.get("pooling_type")
        allowed = TOKEN_POOLING if task.startswith("token_") else SEQ_POOLING
        if kind is not None and kind not in allowed:
            raise ProtocolError(f"unknown pooling_type {kind!r} for task {task!r} (known: {', '.join(allowed)})",
                                field=f"{path}.pooling_type")
        dims = d.get("dimensions")
        if dims is not None:
            if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
                raise ProtocolError(f"dimensions must be a positive integer, got {dims!r}", field=f"{path}.dimensions")
            if task.endswith("classify"):
                raise ProtocolError(f"dimensions applies to embeddings, not task {task!r}", field=f"{path}.dimensions")
        act = d.get("use_activation")
        if act is not None and not isinstance(act, bool):
            raise ProtocolError(f"use_activation must be a boolean, got {wire_type(act)}",
                                field=f"{path}.use_activation")
        return cls(task, kind, dims, True if act is None else act)

    def to_wire(self) -> dict:
        return {"task": self.task, "pooling_type": self.pooling_type, "dimensions": self.dimensions,
                "use_activation": self.use_activation}


@dataclass(frozen=True)
class PoolingModel:
    """What a loaded model offers for pooling (engine/pooling.py measures it at load_model)."""

    hidden_size: int
    default_type: str = "LAST"
    num_labels: int = 0  # > 0: a sequence-classification head (classify, score)
    classify_only: bool = False  # the head replaced the LM head: no sampling requests

    def resolve(self, p: PoolingParams, path: str) -> PoolingParams:
        """The request's params with the model's pooling type filled in, checked against the model."""
        if p.classify and not self.num_labels:
            raise ProtocolError(f"task {p.task!r} needs a sequence-classification head (a *ForSequenceClassification "
                                "checkpoint's `score` weights); this model has none", field=f"{path}.task")
        if p.dimensions is not None and p.dimensions > self.hidden_size:
            raise ProtocolError(f"dimensions {p.dimensions} exceeds the model's hidden size {self.hidden_size}",
                                field=f"{path}.dimensions")
        kind = p.pooling_type or ("ALL" if p.per_token else self.default_type)
        return PoolingParams(p.task, kind, p.dimensions, p.use_activation)


def needs_every_position(p: PoolingParams) -> bool:
    """MEAN, CLS and ALL pool positions a prefix-cache hit would skip: hidden states are not in
    the KV cache, so such a request must be computed from position 0 (the planner refuses a cached
    prefix); LAST pools only the last position, which is always computed."""
    return p.pooling_type != "LAST"
