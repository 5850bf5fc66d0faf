"""A decode step's RoPE (nn.RoPE, mlx-lm's Llama3RoPE) and RMSNorm as compiled graphs on the CPU backend.

On the CPU, `mx.fast.rope` and `mx.fast.rms_norm` are their composite fallbacks: about 29 small
ops per RoPE call (positions, frequencies, cos, sin, the rotation, a concatenate) and 11 per norm,
over half of a small model's decode graph, each op one dispatch on the stream's thread.
Compiled (`mx.compile`), their elementwise runs fuse into a few kernels (RoPE 12 ops, a norm 3),
bit for bit the same result (tests/runner/test_fused_ops.py). Only decode-shaped calls (one
query position: the input shape repeats every step, so each batch size is traced once) with
an array offset take the compiled path; everything else, and every other device (where both
are one kernel already), runs the model's own module unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE

from sidecar.runner.decode_attention import ATTENTION_SWAPS
from sidecar.runner.fused_linear import LINEAR_SWAPS
from sidecar.runner.shared_rope import shared_rope


@functools.lru_cache(maxsize=None)
def _rope(dims: int, traditional: bool, base: float | None, scale: float) -> Callable[[mx.array, mx.array], mx.array]:
    def rope(x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    return mx.compile(rope)


@functools.lru_cache(maxsize=None)
def _rope_freqs(dims: int, traditional: bool) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    def rope(x: mx.array, offset: mx.array, freqs: mx.array) -> mx.array:
        return mx.fast.rope(x, dims, traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs)

    return mx.compile(rope)


@functools.lru_cache(maxsize=None)
def _rms_norm(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    def norm(x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, eps)

    return mx.compile(norm)


class _DecodeCompiledRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if isinstance(offset, mx.array) and x.ndim == 4 and x.shape[-2] == 1:  # [B, H, 1, D]
            key = (self.dims, self.traditional, self.base, self.scale, None)
            return shared_rope(x, offset, key, lambda p: _rope(self.dims, self.traditional, self.base, self.scale)(p, offset))
        return super().__call__(x, offset)


class _DecodeCompiledLlama3RoPE(Llama3RoPE):
    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if isinstance(offset, mx.array) and x.ndim == 4 and x.shape[-2] == 1:
            fkey = self.__dict__.get("_freqs_key")
            if fkey is None or fkey[0] is not self._freqs:
                fkey = (self._freqs, bytes(memoryview(np.array(self._freqs))))
                object.__setattr__(self, "_freqs_key", fkey)  # not a parameter
            key = (self.dims, self.traditional, None, 1.0, fkey[1])
            return shared_rope(x, offset, key, lambda p: _rope_freqs(self.dims, self.traditional)(p, offset, self._freqs))
        return super().__call__(x, offset)


class _DecodeCompiledRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim in (3, 4) and x.shape[1] == 1:  # [B, 1, D] or [B, 1, H, D]
            return _rms_norm(self.eps)(x, self["weight"])
        return super().__call__(x)


_SWAPS: dict[type, type] = {nn.RoPE: _DecodeCompiledRoPE, Llama3RoPE: _DecodeCompiledLlama3RoPE,
                             nn.RMSNorm: _DecodeCompiledRMSNorm, **LINEAR_SWAPS, **ATTENTION_SWAPS}


def _compiles() -> bool:
    """The CPU backend compiles with the system's C++ compiler: check it works before relying on it."""
    try:
        x = mx.ones((1, 1, 1, 4))
        return bool(mx.array_equal(_rope(4, False, 10000.0, 1.0)(x, mx.array([3], dtype=mx.int32)),
                                   mx.fast.rope(x, 4, traditional=False, base=10000.0, scale=1.0, offset=3)).item())
    except Exception:  # noqa: BLE001 - no compiler: run the modules as they are
        return False


def fuse_decode_ops(model: nn.Module) -> int:
    """Swap the model's plain `nn.RoPE`, mlx-lm `Llama3RoPE` and `nn.RMSNorm` modules for the decode-compiled ones
    (CPU only; the class swap keeps parameters and names). Returns how many were swapped."""
    if mx.default_device() != mx.cpu or not _compiles():
        return 0
    n = 0
    for _, m in model.named_modules():
        swap = _SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
            n += 1
    return n
