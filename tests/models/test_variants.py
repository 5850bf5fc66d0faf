"""Checkpoints converted with mlx-lm's own steps (bf16, 4/8-bit affine, mixed per-layer bits, bf16
with 4-bit layers) of the families whose layers differ most serve mlx-lm's greedy tokens on the
same checkpoint; where mlx-lm itself cannot run one on this backend, the sidecar refuses it with a
400 naming why. (scripts/dtype_sweep.py runs every family in every variant.)"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from sidecar.config import Config
from sidecar.errors import ProtocolError
from sidecar.models import variants
from sidecar.worker.mlx_worker import MLXWorker
from tests.conftest import mlx_lm_greedy
from tests.engine.test_architectures import BLOCK, NEW, prompts, serve, served, tiny_dir

# (family, variant, prefill chunk): chunks of 7 are shorter than every prompt. bf16 recurrent
# state is exact only with whole prompts: mlx-lm's own tokens change with its prefill split there.
CASES = [
    ("gpt_oss", "q4g32", 7),  # MoE, attention sinks, sliding window
    ("gpt_oss", "bf16_q4g64", 7),  # bf16 activations, 4-bit experts
    ("deepseek_v3", "q4g32", 7),  # MLA, MoE with a shared expert
    ("gemma3_text", "bf16", 7),  # sliding window
    ("gemma3_text", "mixed_3_6", 7),  # per-layer 3/6 bits
    ("qwen3_next", "q8g64", 7),  # gated delta recurrent layers, MoE
    ("granitemoehybrid", "bf16_q4g64", 7),  # mamba layers with attention
    ("mamba2", "bf16", 64),  # recurrent state in bf16
    ("minimax_m3_vl", "q4g32", 7),  # block-sparse attention, a keys-only indexer cache
    # Each failed before the fix named: a bf16 near-tie mlx-lm's logprob rounding breaks the other
    # way (greedy ranking), and MLA's absorbed one-token path on the last prompt token (prefill split).
    ("cohere", "bf16", 7),
    ("bailing_moe_v3", "bf16_q4g64", 7),
]


def variant_dir(home: str, family: str, variant: str) -> Path:
    return variants.write_variant(tiny_dir(home, family), Path(home) / "variants" / f"{family}-{variant}", variant)


def _is_quantized(m: nn.Module) -> bool:
    return hasattr(m, "scales") and hasattr(m, "bits")


@pytest.mark.parametrize("family,variant,chunk", CASES)
def test_converted_checkpoint_serves_mlx_lm_greedy(home: str, oracle_model, family: str, variant: str,
                                                   chunk: int) -> None:
    d = variant_dir(home, family, variant)
    dtype, bits, _, recipe = variants.VARIANTS[variant]
    w = served(home, d)
    # The sidecar serves the checkpoint as written: quantized layers, half-precision weights.
    quantized = [m for _, m in w.model.named_modules() if _is_quantized(m)]
    assert bool(quantized) == bool(bits or recipe)
    if recipe:
        assert len({m.bits for m in quantized}) == 2  # the recipe's low and high bits, per module
    floats = {v.dtype for _, v in tree_flatten(w.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    assert (mx.bfloat16 in floats) == (dtype == "bfloat16")
    ps = prompts(family, 256)
    lps: dict[str, list[float]] = {}
    got = serve(w, ps, chunk=chunk, logprobs=lps)  # the worker checked above
    oracle = oracle_model(str(d))
    want = {f"r{i}": mlx_lm_greedy(oracle, p, NEW) for i, p in enumerate(ps)}
    assert got == {r: t for r, (t, _) in want.items()}
    if dtype is None:  # float32 activations: logprobs within 1e-4 of mlx-lm's
        assert all(np.allclose(lps[r], lp, atol=1e-4, rtol=0) for r, (_, lp) in want.items())


def test_mixed_recipe_writes_per_module_overrides(home: str) -> None:
    q = variants.config_of(variant_dir(home, "gemma3_text", "mixed_3_6"))["quantization"]
    per_module = {k: v["bits"] for k, v in q.items() if isinstance(v, dict)}
    assert set(per_module.values()) == {3, 6} and any(k.endswith("down_proj") for k in per_module)


@pytest.mark.parametrize("family,variant", [("qwen3_moe", "bf16"), ("gpt_oss", "fp16")])
def test_half_precision_experts_are_refused_as_mlx_lm_cannot_run_them(home: str, family: str, variant: str) -> None:
    d = variant_dir(home, family, variant)
    from mlx_lm.utils import load_model

    with pytest.raises(RuntimeError, match="GatherMM"):  # mlx-lm itself, on this backend
        mlx_lm_greedy(load_model(d)[0], [5, 6, 7], 1)
    w = MLXWorker(Config(model=str(d), home=home, block_size=BLOCK))
    w.init_device()
    with pytest.raises(ProtocolError, match="mixture-of-experts matmuls in float32 only") as e:
        w.load_model()
    assert e.value.status == 400 and e.value.field == "model" and w.runner is None
