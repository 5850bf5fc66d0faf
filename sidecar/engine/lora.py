"""Multi-LoRA serving: mlx-lm LoRA adapters applied per request inside one batch.

Each adapted Linear is wrapped once in `MultiLoRALinear`, which adds, for every adapter present in
the step, `scale * (x[rows] @ lora_a) @ lora_b` to just the rows that use it. A step without LoRA
rows costs one Python check per wrapped layer. Adapters come from mlx-lm's format
(adapter_config.json + adapters.safetensors) and only from under the allow-listed `--lora-dir`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from sidecar.errors import ProtocolError

_MAX_PATH, _MAX_NAME = 1024, 255  # bytes: below every OS's PATH_MAX / NAME_MAX
_MAX_CONFIG = 1 << 20  # adapter_config.json bytes read at most (a real one is < 1 KiB)


@dataclass
class Adapter:
    lora_id: int
    name: str
    path: str
    weights: dict[str, tuple[mx.array, mx.array]]  # module path -> (lora_a [in, r], lora_b [r, out])
    scale: float
    pinned: bool = False


class _Rows:
    """Per forward: which rows use which adapter (shared by every wrapped layer)."""

    groups: list[tuple[int, mx.array]] = []  # (lora_id, row indices)


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rows: _Rows):
        super().__init__()
        self.base = base
        # Plain attributes, not module state: adapters stay out of model.parameters().
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_adapters", {})
        self._adapters: dict[int, tuple[mx.array, mx.array, float]]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        for lora_id, idx in self._rows.groups:
            ab = self._adapters.get(lora_id)
            if ab is not None:
                a, b, scale = ab
                y[idx] = y[idx] + (scale * ((x[idx] @ a) @ b)).astype(y.dtype)
        return y


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


@dataclass
class LoRAManager:
    model: nn.Module
    lora_dir: str | None
    max_loras: int = 8
    adapters: dict[int, Adapter] = field(default_factory=dict)
    rows: _Rows = field(default_factory=_Rows)

    def resolve(self, path: Any, field_path: str) -> tuple[Path, Path]:
        """The adapter's two files, each resolved (symlinks, "..") and inside --lora-dir. Messages
        name the caller's relative path only, never a server path."""
        if self.lora_dir is None:
            raise ProtocolError("LoRA loading is disabled: start the server with --lora-dir", field=field_path)
        if not isinstance(path, str) or not path:
            raise ProtocolError("lora_path must be a non-empty string", field=field_path)
        shown = repr(path) if len(path) <= 80 else repr(path[:77] + "...")
        if "\x00" in path:
            raise ProtocolError("lora_path must not contain a NUL character", field=field_path)
        if len(path.encode("utf-8", "replace")) > _MAX_PATH or any(len(p.encode("utf-8", "replace")) > _MAX_NAME
                                                                    for p in path.split("/")):
            raise ProtocolError(f"lora_path is too long (at most {_MAX_PATH} bytes, {_MAX_NAME} per name)", field=field_path)
        root = Path(os.path.realpath(self.lora_dir))
        files = []
        for name in ("adapter_config.json", "adapters.safetensors"):
            try:
                full = Path(os.path.realpath(root / path / name))
                ok = full.is_file()
            except (OSError, ValueError):
                full, ok = root, False
            # Every file is resolved on its own: a symlinked file may not point out of the directory.
            if root not in full.parents:
                raise ProtocolError(f"lora_path {shown} is outside the LoRA directory", field=field_path)
            if not ok:
                raise ProtocolError(f"lora_path {shown} is not an mlx-lm adapter directory "
                                    "(adapter_config.json + adapters.safetensors)", field=field_path)
            files.append(full)
        return files[0], files[1]

    def add(self, lora_id: int, name: str, path: str, in_use: set[int]) -> bool:
        if lora_id in self.adapters:
            return False  # vLLM: adding a loaded id is a no-op that reports False
        fp = "lora_request.lora_path"
        config_file, weights_file = self.resolve(path, fp)
        try:
            with open(config_file, "rb") as f:  # bounded: the file may be any size
                text = f.read(_MAX_CONFIG + 1)
            if len(text) > _MAX_CONFIG:
                raise ProtocolError(f"the adapter's adapter_config.json is over {_MAX_CONFIG >> 20} MiB", field=fp)
            config = json.loads(text)
            params = config.get("lora_parameters", {})
            scale = float(params.get("scale", 20.0))
            kind = config.get("fine_tune_type", "lora")
        except (OSError, ValueError, TypeError, AttributeError, RecursionError):
            raise ProtocolError("the adapter's adapter_config.json is not a valid mlx-lm adapter config "
                                "(a JSON map; lora_parameters.scale a number)", field=fp) from None
        if kind != "lora":
            raise ProtocolError(f"only LoRA adapters are supported, not {str(kind)[:40]!r}", field=fp)
        if not math.isfinite(scale):
            raise ProtocolError("lora_parameters.scale must be a finite number", field=fp)
        try:
            raw = mx.load(str(weights_file), format="safetensors")
            if not isinstance(raw, dict):
                raise ValueError
        except Exception:  # noqa: BLE001 - MLX's messages carry the server path
            raise ProtocolError("the adapter's adapters.safetensors is not a valid safetensors file", field=fp) from None
        modules = _modules(self.model)
        weights: dict[str, tuple[mx.array, mx.array]] = {}
        for key, a in raw.items():
            if not key.endswith(".lora_a"):
                continue
            mod_path = key[: -len(".lora_a")]
            b = raw.get(mod_path + ".lora_b")
            mod = modules.get(mod_path)
            if isinstance(mod, MultiLoRALinear):
                mod = mod.base
            if (b is None or not isinstance(mod, (nn.Linear, nn.QuantizedLinear)) or ".layers." not in f".{mod_path}"
                    or a.ndim != 2 or b.ndim != 2 or not mx.issubdtype(a.dtype, mx.floating)
                    or not mx.issubdtype(b.dtype, mx.floating)):
                raise ProtocolError(f"adapter weight {key[:100]!r} matches no Linear layer of the model (or is not a "
                                    "2-D float matrix)",
                                    field="lora_request.lora_path")
            out_dims, in_dims = mod.weight.shape
            if isinstance(mod, nn.QuantizedLinear):
                in_dims = in_dims * 32 // mod.bits
            if a.shape[0] != in_dims or b.shape[1] != out_dims or a.shape[1] != b.shape[0]:
                raise ProtocolError(f"adapter weight {key!r} has shape {a.shape}/{b.shape}, the layer is "
                                    f"{in_dims}->{out_dims}", field="lora_request.lora_path")
            weights[mod_path] = (a, b)
        if not weights:
            raise ProtocolError("the adapter has no lora_a/lora_b weights", field="lora_request.lora_path")
        if len(self.adapters) >= self.max_loras and not self._evict(in_use):
            return False
        mx.eval([w for ab in weights.values() for w in ab])
        for mod_path, (a, b) in weights.items():
            self._wrap(mod_path)._adapters[lora_id] = (a, b, scale)
        self.adapters[lora_id] = Adapter(lora_id, name, str(config_file.parent), weights, scale)
        return True

    def _wrap(self, mod_path: str) -> MultiLoRALinear:
        parent_path, _, leaf = mod_path.rpartition(".")
        parent = _modules(self.model)[parent_path]
        mod = getattr(parent, leaf)
        if not isinstance(mod, MultiLoRALinear):
            mod = MultiLoRALinear(mod, self.rows)
            setattr(parent, leaf, mod)
        return mod

    def attach(self, model: nn.Module) -> None:
        """A reloaded model (wake_up after sleep level 2): wrap its layers for the loaded adapters again."""
        self.model = model
        for lora_id, ad in self.adapters.items():
            for mod_path, (a, b) in ad.weights.items():
                self._wrap(mod_path)._adapters[lora_id] = (a, b, ad.scale)

    def _evict(self, in_use: set[int]) -> bool:
        for lora_id, ad in self.adapters.items():  # oldest first
            if not ad.pinned and lora_id not in in_use:
                self.remove(lora_id, in_use)
                return True
        return False

    def remove(self, lora_id: int, in_use: set[int]) -> bool:
        if lora_id not in self.adapters or lora_id in in_use:
            return False
        for mod_path in self.adapters.pop(lora_id).weights:
            mod = _modules(self.model)[mod_path]
            if isinstance(mod, MultiLoRALinear):
                mod._adapters.pop(lora_id, None)
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.adapters:
            return False
        self.adapters[lora_id].pinned = True
        return True

    def set_rows(self, lora_ids: list[int]) -> None:
        """Before a forward: group the batch's rows by adapter (0 = none)."""
        groups: dict[int, list[int]] = {}
        for row, lora_id in enumerate(lora_ids):
            if lora_id:
                groups.setdefault(lora_id, []).append(row)
        self.rows.groups = [(k, mx.array(v)) for k, v in groups.items()]
