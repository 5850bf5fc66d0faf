"""Decode steps take the layout-free attention on llama, qwen2 and qwen3, and greedy decoding still
gives mlx-lm's tokens and logprobs: one stream crossing blocks, and a batch of rows whose lengths
differ (padding masked); prefill chunks run the model's own attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.runner import decode_attention
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.runner.test_fused_ops import nodes
from tests.runner.test_model_runner import prompts


def spy_calls(monkeypatch: pytest.MonkeyPatch, drop_mask: bool = False) -> list[int]:
    """Counts the decode-path calls (their batch sizes); `drop_mask` breaks the path on purpose."""
    seen: list[int] = []
    real = decode_attention._decode_call

    def spy(self, x, mask, cache):
        out = real(self, x, None if drop_mask else mask, cache)
        if out is not None:
            seen.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_attention, "_decode_call", spy)
    return seen


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen2", "builtin:tiny-qwen3", "builtin:tiny-kv64"])
def test_batch_matches_mlx_lm(make_worker, oracle_model, monkeypatch, model: str) -> None:
    w = make_worker(model)
    seen = spy_calls(monkeypatch)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = prompts(w.vocab_size(), [3, 21, 40], seed=5)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, {"temperature": 0.0, "logprobs": 0})
    got = d.run(20, chunk=64)
    assert 3 in seen  # the batch of three decoded on this path
    for i, p in enumerate(ps):
        want, want_lp = mlx_lm_greedy(oracle_model(model), p, 20)
        assert got[f"r{i}"] == want, f"{model} row {i}"
        np.testing.assert_allclose(d.reqs[f"r{i}"].logprobs[:20], want_lp, atol=1e-4)


def test_long_stream_matches_mlx_lm(make_worker, oracle_model, monkeypatch) -> None:
    w = make_worker()
    seen = spy_calls(monkeypatch)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompts(w.vocab_size(), [300], seed=8)[0]  # ~19 blocks of 16, crossing more while decoding
    d.add("a", p, {"temperature": 0.0, "logprobs": 0})
    got = d.run(40, chunk=128)
    assert seen and set(seen) == {1}
    want, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), p, 40)
    assert got["a"] == want
    np.testing.assert_allclose(d.reqs["a"].logprobs[:40], want_lp, atol=1e-4)


def test_a_dropped_mask_is_caught(make_worker, oracle_model, monkeypatch) -> None:
    """Negative control: the batch check above sees the padding mask (shorter rows read padding
    slots past their context); the path without it decodes other tokens."""
    w = make_worker()
    spy_calls(monkeypatch, drop_mask=True)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = prompts(w.vocab_size(), [3, 40], seed=5)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p)
    got = d.run(12, chunk=64)
    assert got["r0"] != mlx_lm_greedy(oracle_model("builtin:tiny"), ps[0], 12)[0]


def test_the_decode_graph_is_smaller(tmp_path, make_worker) -> None:
    """The whole decode-ahead forward of builtin:tiny: ~180 nodes with the modules as they are, ~105 here."""
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", prompts(w.vocab_size(), [20], seed=1)[0])
    counts = []
    for _ in range(5):
        d.step()
        todo = w.runner._dispatch  # the next step's forward, built, not yet dispatched
        if todo:
            counts.append(nodes(tmp_path, todo[0]))
        w.after_reply()
    assert counts and max(counts) < 120, counts
    assert decode_attention.ATTENTION_SWAPS  # llama, qwen2, qwen3
    assert mx.default_device() == mx.cpu
