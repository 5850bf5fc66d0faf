from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

MODELS = ["builtin:tiny", "builtin:tiny-qwen3"]


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("model", MODELS)
def test_batched_chunked_matches_mlx_lm(make_worker, oracle_model, model: str) -> None:
    w = make_worker(model)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = prompts(w.vocab_size(), [1, 7, 33, 70])
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, {"temperature": 0.0, "logprobs": 0})
    got = d.run(24, chunk=16)
    for i, p in enumerate(ps):
        want, want_lp = mlx_lm_greedy(oracle_model(model), p, 24)
        assert got[f"r{i}"] == want, f"prompt {i} (len {len(p)})"
        np.testing.assert_allclose(d.reqs[f"r{i}"].logprobs[:24], want_lp, atol=1e-4)


def test_pool_is_updated_in_place(make_worker) -> None:
    """The step writes into the pool without copying it: the same buffer before and after."""
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7])
    d.step()
    before = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    d.step()
    after = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    assert before == after


def _prefix_setup(make_worker):
    w = make_worker()
    bs = w.config.block_size
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    shared = prompts(w.vocab_size(), [2 * bs], seed=1)[0]
    a = d.add("A", shared + [9, 10, 11])
    d.run(1)
    return w, d, shared, a


def test_prefix_cache_hit_gives_same_tokens(make_worker) -> None:
    w, d, shared, a = _prefix_setup(make_worker)
    bs = w.config.block_size
    tail = [40, 41, 42, 43, 44]
    # B reuses A's first two full blocks: only its tail is computed.
    d.add("B", shared + tail, blocks=a.blocks[:2] + d.alloc(3), computed=2 * bs)
    d.add("C", shared + tail)  # the same prompt from scratch
    got = d.run(8)
    assert got["B"] == got["C"]


def test_prefix_cache_negative_control(make_worker) -> None:
    """A corrupted shared block changes B's tokens, so the hit test above can fail."""
    w, d, shared, a = _prefix_setup(make_worker)
    bs = w.config.block_size
    tail = [40, 41, 42, 43, 44]
    pool = w.runner.pool
    for i in range(len(pool.keys)):
        slots = mx.arange(a.blocks[1] * bs, (a.blocks[1] + 1) * bs)
        pool.keys[i][slots] = mx.random.normal(pool.keys[i][slots].shape) * 10
    mx.eval(pool.keys)
    d.add("B", shared + tail, blocks=a.blocks[:2] + d.alloc(3), computed=2 * bs)
    d.add("C", shared + tail)
    got = d.run(8)
    assert got["B"] != got["C"]


def test_preemption_and_resume_gives_same_tokens(make_worker) -> None:
    w = make_worker()
    ps = prompts(w.vocab_size(), [20, 9], seed=2)
    ref = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    for i, p in enumerate(ps):
        ref.add(f"x{i}", p)
    want = ref.run(12, chunk=8)
    for rid in list(ref.reqs):
        ref.finish(rid)
    ref.step()  # frees them on the worker

    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    for i, p in enumerate(ps):
        d.add(f"y{i}", p)
    for _ in range(6):
        d.step(chunk=8)
    d.preempt("y0")
    d.step(chunk=8, only=["y1"])  # y0 is dropped from this step
    d.step(chunk=8, only=["y1"])
    got = d.run(12, chunk=8)
    assert got == {"y0": want["x0"], "y1": want["x1"]}
    assert len(d.reqs["y0"].out) >= 12


def test_finished_requests_free_state(make_worker) -> None:
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [3, 4, 5])
    d.add("b", [6, 7])
    d.step()
    assert set(w.runner.requests) == {"a", "b"}
    d.finish("a")
    d.step()
    assert set(w.runner.requests) == {"b"}
