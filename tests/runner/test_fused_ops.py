"""The decode-compiled RoPE and RMSNorm give the model's own modules' results bit for bit, in
fewer graph nodes, and only decode-shaped calls take the compiled path."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from sidecar.runner.fused_ops import _DecodeCompiledRMSNorm, _DecodeCompiledRoPE, fuse_decode_ops


def nodes(tmp_path, a: mx.array) -> int:
    path = str(tmp_path / "g.dot")
    mx.export_to_dot(path, a)
    with open(path) as f:
        return len(re.findall(r'label ="[A-Za-z_]+', f.read()))


class Block(nn.Module):
    def __init__(self, dims: int, base: float, traditional: bool):
        super().__init__()
        self.rope = nn.RoPE(dims, traditional=traditional, base=base)
        self.norm = nn.RMSNorm(32, eps=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("dims,base,traditional", [(16, 10000.0, False), (8, 500000.0, True), (12, 1e6, False)])
def test_fused_equals_the_module_bit_for_bit(tmp_path, dtype, dims, base, traditional) -> None:
    plain, fused = Block(dims, base, traditional), Block(dims, base, traditional)
    fused.update(plain.parameters())
    assert fuse_decode_ops(fused) == 2
    assert type(fused.rope) is _DecodeCompiledRoPE and type(fused.norm) is _DecodeCompiledRMSNorm
    mx.random.seed(dims)
    for B, L, offsets in [(1, 1, [0]), (1, 1, [4097]), (3, 1, [5, 70, 1200]), (2, 5, [3, 9])]:
        x = mx.random.normal((B, 4, L, 16)).astype(dtype)
        off = mx.array(offsets, dtype=mx.int32)
        assert mx.array_equal(fused.rope(x, off), plain.rope(x, off)).item(), (B, L, offsets)
        h = (mx.random.normal((B, L, 32)) * 3).astype(dtype)
        assert mx.array_equal(fused.norm(h), plain.norm(h)).item(), (B, L)
    # The decode path really is the compiled one (fewer nodes); a prefill chunk is the module's own.
    x, off = mx.random.normal((1, 4, 1, 16)).astype(dtype), mx.array([7], dtype=mx.int32)
    assert nodes(tmp_path, fused.rope(x, off)) < nodes(tmp_path, plain.rope(x, off))
    h = mx.random.normal((1, 1, 32)).astype(dtype)
    assert nodes(tmp_path, fused.norm(h)) < nodes(tmp_path, plain.norm(h))
    x5 = mx.random.normal((1, 4, 5, 16)).astype(dtype)
    assert nodes(tmp_path, fused.rope(x5, off)) == nodes(tmp_path, plain.rope(x5, off))
    # An int offset (a model wanting scalar offsets) is never traced as a constant.
    assert mx.array_equal(fused.rope(x, 9), plain.rope(x, 9)).item()
    assert nodes(tmp_path, fused.rope(x, 9)) == nodes(tmp_path, plain.rope(x, 9))


def test_llama3_rope_is_fused_bit_for_bit(tmp_path) -> None:
    from mlx_lm.models.rope_utils import Llama3RoPE

    cfg = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain, fused = Llama3RoPE(16, 131072, False, 500000.0, cfg), Llama3RoPE(16, 131072, False, 500000.0, cfg)
    holder = nn.Sequential(fused)
    assert fuse_decode_ops(holder) == 1 and type(holder.layers[0]).__name__ == "_DecodeCompiledLlama3RoPE"
    for B, offsets in [(1, [0]), (1, [30000]), (3, [4, 900, 70000])]:
        x, off = mx.random.normal((B, 4, 1, 16)), mx.array(offsets, dtype=mx.int32)
        assert mx.array_equal(fused(x, off), plain(x, off)).item(), offsets
    assert nodes(tmp_path, fused(x, off)) < nodes(tmp_path, plain(x, off))


def test_only_plain_modules_are_swapped() -> None:
    class Custom(nn.RoPE):
        pass

    m = nn.Sequential(Custom(8), nn.LayerNorm(8), nn.RMSNorm(8))
    assert fuse_decode_ops(m) == 1
    assert type(m.layers[0]) is Custom and type(m.layers[1]) is nn.LayerNorm
    assert type(m.layers[2]) is _DecodeCompiledRMSNorm
    assert fuse_decode_ops(m) == 0  # already swapped


def test_the_runner_fuses_its_model(make_worker) -> None:
    runner = make_worker().runner
    kinds = {type(m) for _, m in runner.model.named_modules()}
    assert _DecodeCompiledRoPE in kinds and nn.RoPE not in kinds
