"""A decode-shaped Linear (and tied LM head) is one graph node for one row, bit for bit the module's
own product; a replaced weight is seen; other shapes are the module's own code."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from sidecar.runner.fused_linear import DecodeEmbedding, DecodeLinear
from sidecar.runner.fused_ops import fuse_decode_ops
from tests.runner.test_fused_ops import nodes


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_the_module_bit_for_bit(tmp_path, dtype, bias: bool) -> None:
    plain = nn.Linear(64, 48, bias=bias)
    plain.set_dtype(dtype)
    fused = nn.Linear(64, 48, bias=bias)
    fused.update(plain.parameters())
    assert fuse_decode_ops(nn.Sequential(fused)) == 1 and type(fused) is DecodeLinear
    for shape in [(1, 1, 64), (3, 1, 64), (1, 5, 64), (2, 64)]:
        x = mx.random.normal(shape, key=mx.random.key(shape[0])).astype(dtype)
        assert mx.array_equal(fused(x), plain(x)).item(), shape
    x = mx.random.normal((1, 1, 64)).astype(dtype)
    mx.eval(x, fused(x))  # the views are made (and evaluated) on first use
    assert nodes(tmp_path, fused(x)) == 1 < nodes(tmp_path, plain(x))  # Matmul (AddMM with a bias)
    x5 = mx.random.normal((1, 5, 64)).astype(dtype)
    mx.eval(x5)
    assert nodes(tmp_path, fused(x5)) == nodes(tmp_path, plain(x5))  # a prefill chunk: the module's own


def test_a_replaced_weight_is_used() -> None:
    """Negative control for the cached views: new weights give the new product, not the old one."""
    lin = nn.Linear(16, 8, bias=False)
    fuse_decode_ops(nn.Sequential(lin))
    x = mx.random.normal((1, 1, 16))
    before = lin(x)
    lin.update({"weight": lin.weight * 2})
    after = lin(x)
    assert not mx.array_equal(before, after).item()
    assert mx.array_equal(after, x @ lin.weight.T).item()
    assert "_decode_views" not in lin.parameters()  # the views are no parameter


def test_tied_head_is_the_module_bit_for_bit(tmp_path) -> None:
    plain, fused = nn.Embedding(512, 64), nn.Embedding(512, 64)
    fused.update(plain.parameters())
    fuse_decode_ops(nn.Sequential(fused))
    assert type(fused) is DecodeEmbedding
    for B in (1, 4):
        h = mx.random.normal((B, 1, 64))
        mx.eval(h)
        assert mx.array_equal(fused.as_linear(h), plain.as_linear(h)).item()
    assert mx.array_equal(fused(mx.array([[3, 9]])), plain(mx.array([[3, 9]]))).item()
    assert nodes(tmp_path, fused.as_linear(h[:1])) < nodes(tmp_path, plain.as_linear(h[:1]))
