"""Model resolution: built-in generated models and local mlx-lm model directories."""

from __future__ import annotations

from sidecar.models.builtin import BUILTIN_MODELS, BuiltinSpec, needs_building, resolve_model
from sidecar.models.store import BUILTIN_PREFIX, ModelNotFound, cache_home

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PREFIX",
    "BuiltinSpec",
    "ModelNotFound",
    "cache_home",
    "needs_building",
    "resolve_model",
]
