"""What the worker reports about its loaded model, read from the model and its config files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from sidecar.kv.pool import DTYPES, dtype_name


def weights_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def model_dtype(model: nn.Module) -> mx.Dtype:
    for _, v in tree_flatten(model.parameters()):
        if v.dtype in DTYPES.values():
            return v.dtype
    return mx.float16


def vocab_size(model_config: dict) -> int:
    if "vocab_size" in model_config:
        return int(model_config["vocab_size"])
    return int(model_config["text_config"]["vocab_size"])


def eos_ids(model_config: dict, model_path: Path) -> list[int]:
    ids: list[int] = []
    sources = [model_config]
    gen = model_path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        v = src.get("eos_token_id")
        ids += v if isinstance(v, list) else [] if v is None else [v]
    return sorted(set(ids))


def describe(worker: Any) -> dict:
    """get_model's map: type, layers, sizes, params, dtype, path."""
    model, runner, mc = worker.model, worker.runner, worker.model_config
    c = mc.get("text_config", mc)
    return {
        "type": c.get("model_type"), "num_layers": len(model.layers),
        "hidden_size": c.get("hidden_size"), "num_attention_heads": c.get("num_attention_heads"),
        "num_kv_heads": next((s.num_kv_heads for s in runner.specs if s.kind != "state"), 0) if runner else None,
        "vocab_size": vocab_size(mc), "params": sum(v.size for _, v in tree_flatten(model.parameters())),
        "weights_bytes": worker.weights_bytes, "dtype": dtype_name(model_dtype(model)),
        "quantization": mc.get("quantization"), "max_model_len": runner.max_model_len if runner else None,
        "eos_token_ids": eos_ids(mc, worker.model_path), "path": str(worker.model_path), "name": worker.config.model,
        # What pooling requests may ask (docs/protocol.md, Pooling); null: generation only.
        "pooling": runner.pooling.__dict__ if runner is not None and runner.pooling is not None else None,
    }

