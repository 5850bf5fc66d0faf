"""A step's RoPE angles are computed once for every call given the same offsets array, the rotation
stays `mx.fast.rope`'s bit for bit (also tests/runner/test_fused_ops.py), and another offsets array
(the next step) gets its own angles."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from sidecar.runner.fused_ops import fuse_decode_ops


def labels(tmp_path, *arrays: mx.array) -> list[str]:
    path = str(tmp_path / "g.dot")
    mx.export_to_dot(path, *arrays)
    with open(path) as f:
        return re.findall(r'label ="([A-Za-z_]+)', f.read())


@pytest.mark.parametrize("dims,traditional", [(16, False), (8, True), (12, False)])
def test_q_and_k_of_all_layers_share_one_angle_table(tmp_path, dims: int, traditional: bool) -> None:
    plain = [nn.RoPE(dims, traditional=traditional, base=10000.0) for _ in range(2)]
    fused = [nn.RoPE(dims, traditional=traditional, base=10000.0) for _ in range(2)]
    assert fuse_decode_ops(nn.Sequential(*fused)) == 2
    off = mx.array([3, 700, 41], dtype=mx.int32)
    xs = [mx.random.normal((3, h, 1, 16), key=mx.random.key(h)) for h in (4, 2, 4, 2)]  # q, k, q, k
    mx.eval(xs, off)
    outs = [fused[i // 2](x, off) for i, x in enumerate(xs)]
    assert labels(tmp_path, *outs).count("Cos") == 1  # one table for four calls (before they are evaluated)
    for i, (x, o) in enumerate(zip(xs, outs)):
        assert mx.array_equal(o, plain[i // 2](x, off)).item(), i

    # Negative control: the same values in a new array (the next step's layout) are not matched by
    # value; a new step with new offsets gets its own, right, angles.
    a1, a2 = mx.array([3, 700, 41], dtype=mx.int32), mx.array([3, 700, 41], dtype=mx.int32)
    mx.eval(a1, a2)
    assert labels(tmp_path, fused[0](xs[0], a1), fused[0](xs[0], a2)).count("Cos") == 2
    nxt = mx.array([4, 701, 42], dtype=mx.int32)
    got, want = fused[1](xs[1], nxt), plain[1](xs[1], nxt)
    assert mx.array_equal(got, want).item()
    assert not mx.array_equal(got, plain[1](xs[1], off)).item()


def test_other_bases_do_not_share(tmp_path) -> None:
    a, b = nn.RoPE(16, base=10000.0), nn.RoPE(16, base=1e6)
    fuse_decode_ops(nn.Sequential(a, b))
    x, off = mx.random.normal((1, 4, 1, 16)), mx.array([900], dtype=mx.int32)
    assert mx.array_equal(b(x, off), nn.RoPE(16, base=1e6)(x, off)).item()
    assert mx.array_equal(a(x, off), nn.RoPE(16, base=10000.0)(x, off)).item()
    assert not mx.array_equal(a(x, off), b(x, off)).item()
