"""A decode step's `nn.Linear` (and a tied `nn.Embedding.as_linear` LM head) in one graph node on the CPU backend.

`x @ W.T` on a decode-shaped `[B, 1, D]` input is four nodes: a Transpose of the weight (a view,
rebuilt every call), and around the Matmul a Flatten and Unflatten folding the batch into rows.
Each node costs the MLX thread one dispatch (~1.8 us on the CPU backend), the same as a real
kernel. Here the transposed weight is made once per weight array as an evaluated view (no copy:
it shares the weight's buffer), `[1, D, N]` for one row, whose batched Matmul against `[1, 1, D]`
needs no folding: one node. Several rows use the `[D, N]` view (Flatten, Matmul, Unflatten).
The product is the same BLAS call on the same memory, bit for bit (tests/runner/test_fused_linear.py).

The views live in the module's own `__dict__` (not its parameters), keyed by the weight array's
identity: a replaced weight (a LoRA merge, `model.update`, `set_model`) is seen, and dropping the
model drops them with it. Every other shape runs the module's own code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _Views:
    """The transposed views of one weight (and its bias broadcast to one row)."""

    __slots__ = ("weight", "t2", "t3", "bias", "bias3")

    def __init__(self, weight: mx.array, bias: Any):
        self.weight, self.bias = weight, bias
        self.t2 = weight.T
        self.t3 = self.t2[None]
        self.bias3 = None if bias is None else bias[None, None]
        mx.eval(self.t2, self.t3, *([] if bias is None else [self.bias3]))


def _views(module: nn.Module, weight: mx.array, bias: Any) -> _Views:
    v = module.__dict__.get("_decode_views")
    if v is None or v.weight is not weight or v.bias is not bias:
        v = _Views(weight, bias)
        object.__setattr__(module, "_decode_views", v)  # not a parameter: nn.Module would file an array under its keys
    return v


def _project(module: nn.Module, x: mx.array, weight: mx.array, bias: Any) -> mx.array:
    v = _views(module, weight, bias)
    if x.shape[0] == 1:
        return x @ v.t3 if bias is None else mx.addmm(v.bias3, x, v.t3)
    return x @ v.t2 if bias is None else mx.addmm(bias, x, v.t2)


def _decode_shaped(x: mx.array) -> bool:
    return x.ndim == 3 and x.shape[1] == 1


class DecodeLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if _decode_shaped(x):
            return _project(self, x, self["weight"], self["bias"] if "bias" in self else None)
        return super().__call__(x)


class DecodeEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if _decode_shaped(x):
            return _project(self, x, self["weight"], None)
        return super().as_linear(x)


LINEAR_SWAPS: dict[type, type] = {nn.Linear: DecodeLinear, nn.Embedding: DecodeEmbedding}
