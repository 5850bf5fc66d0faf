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
    assert w.runner.ahead_hits > 0  # the overlapped decode forward was used
    for i, p in enumerate(ps):
        want, want_lp = mlx_lm_greedy(oracle_model(model), p, 24)
        assert got[f"r{i}"] == want, f"prompt {i} (len {len(p)})"
        np.testing.assert_allclose(d.reqs[f"r{i}"].logprobs[:24], want_lp, atol=1e-4)


def _addresses(arrays: list) -> list[int]:
    return [np.asarray(a).__array_interface__["data"][0] for a in arrays]


def test_pool_is_updated_in_place(make_worker) -> None:
    """Every step writes into the pool without copying it: the same buffers before and after,
    across a block boundary, with the next decode forward queued as each step returns. (Queued
    before the step's own tasks were done, MLX could not donate the buffers a task still held:
    most steps would copy every layer's pool.)"""
    w = make_worker()
    step = w.execute_model

    d = Driver(step, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7])
    d.step()
    copied = []
    for i in range(20):
        before = _addresses(w.runner.pool.keys)
        d.step()
        if before != _addresses(w.runner.pool.keys):
            copied.append(i)
    assert not copied, copied


@pytest.mark.parametrize("settle", [True, False])
def test_a_step_of_several_forwards_updates_the_pool_in_place(make_worker, monkeypatch, settle: bool) -> None:
    """A prompt's head, its last token and another request's decode are forwards of one step, each
    writing every layer's pool: still no copy. Negative control: without evaluating the earlier
    forwards first, their pending reads make MLX copy the pools."""
    w = make_worker()
    if not settle:
        monkeypatch.setattr(w.runner, "_settle", lambda: setattr(w.runner, "_built", []))
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7])
    d.step()
    d.add("b", list(range(3, 40)))
    before = _addresses(w.runner.pool.arrays())
    d.step(chunk=64)  # a's decode, b's whole prompt: b's head, then its last token with a
    after = _addresses(w.runner.pool.arrays())
    assert len(d.reqs["a"].out) == 2 and len(d.reqs["b"].out) == 1
    assert (before == after) == settle


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
        pool.keys[i][:, :, slots] = mx.random.normal(pool.keys[i][:, :, slots].shape) * 10
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


def test_prompt_logprobs_across_chunks_match_one_mlx_lm_forward(make_worker, oracle_model) -> None:
    w = make_worker()
    prompt = prompts(w.vocab_size(), [40], seed=3)[0]
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("p", prompt, {"temperature": 0.0, "prompt_logprobs": 3})
    rows: list[list[float]] = []
    ids: list[list[int]] = []
    while d.reqs["p"].computed < len(prompt):
        out = d.step(chunk=16)
        plp = out["prompt_logprobs_dict"]["p"]
        rows += plp["logprobs"]
        ids += plp["logprob_token_ids"]
    logits = oracle_model("builtin:tiny")(mx.array([prompt]))[0].astype(mx.float32)
    ref = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert len(rows) == len(prompt) - 1
    assert [r[0] for r in ids] == prompt[1:]
    np.testing.assert_allclose([r[0] for r in rows], [ref[i, prompt[i + 1]] for i in range(len(prompt) - 1)], atol=1e-4)
    top = np.argsort(-ref[:-1], axis=-1)[:, :3]
    assert [r[1:] for r in ids] == top.tolist()


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_after_preemption(make_worker) -> None:
    w = make_worker()
    prompt = prompts(w.vocab_size(), [12], seed=4)[0]
    params = {"temperature": 1.0, "seed": 1234}

    def run(extra: int, preempt: bool) -> list[int]:
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("s", prompt, params)
        for i, p in enumerate(prompts(w.vocab_size(), [5] * extra, seed=5)):
            d.add(f"o{i}", p, {"temperature": 0.7 + 0.1 * i, "top_k": 5 + i})
        for _ in range(4):
            d.step(chunk=16)
        if preempt:
            d.preempt("s")
            d.step(chunk=16, only=[r for r in d.reqs if r != "s"])
        out = d.run(10, chunk=16)["s"]
        for rid in list(d.reqs):
            d.finish(rid)
        d.step()
        return out

    alone = run(0, False)
    assert w.runner.ahead_hits > 0  # sampled rows use the overlapped forward too
    assert run(6, False) == alone
    assert run(6, True) == alone
    params["seed"] = 4321  # negative control: another seed, other tokens
    assert run(0, False) != alone


def test_internal_error_rolls_back_and_the_worker_keeps_serving(make_worker, oracle_model, monkeypatch) -> None:
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", list(range(3, 20)))
    d.step()
    before = {rid: (s.num_computed_tokens, list(s.output_token_ids), list(s.block_ids)) for rid, s in w.runner.requests.items()}
    real = w.runner.forward

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(w.runner, "forward", boom)
    so = d.build(chunk=16)
    with pytest.raises(RuntimeError, match="injected"):
        w.execute_model(so)
    after = {rid: (s.num_computed_tokens, list(s.output_token_ids), list(s.block_ids)) for rid, s in w.runner.requests.items()}
    assert after == before
    monkeypatch.setattr(w.runner, "forward", real)
    d.commit(so, w.execute_model(so).to_wire())  # the same step now succeeds
    assert d.reqs["a"].out == mlx_lm_greedy(oracle_model("builtin:tiny"), list(range(3, 20)), 1)[0]


def test_quantized_model_matches_mlx_lm(home: str, make_worker, tmp_path) -> None:
    """A 4-bit model made by mlx-lm's own converter runs through the paged cache token-exact."""
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    from sidecar.models import resolve_model

    dst = tmp_path / "tiny-4bit"
    convert(str(resolve_model("builtin:tiny", home)), mlx_path=str(dst), quantize=True, q_group_size=32, q_bits=4)
    w = make_worker(str(dst))
    assert w.get_model()["quantization"]["bits"] == 4
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = prompts(w.vocab_size(), [5, 30], seed=6)
    for i, p in enumerate(ps):
        d.add(f"q{i}", p)
    got = d.run(12, chunk=16)
    oracle = load_model(dst)[0]
    for i, p in enumerate(ps):
        assert got[f"q{i}"] == mlx_lm_greedy(oracle, p, 12)[0]


def test_decode_ahead_is_invisible_to_the_scheduler(make_worker, oracle_model) -> None:
    """The reference scheduler, with chunking, prefix hits, preemption and finishes, gets the same
    tokens with the overlapped decode forward on and off, and they are mlx-lm's."""
    from sidecar.scheduler import Request, Scheduler, run

    ps = prompts(512, [40, 9, 33, 17, 40, 3], seed=7)
    ps[4] = ps[0][:32] + ps[4][32:]  # a shared prefix: real prefix-cache hits
    results = []
    for ahead in (True, False):
        w = make_worker(num_blocks=24, decode_ahead=ahead)
        sched = Scheduler(num_blocks=10, block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
        for i, p in enumerate(ps):
            sched.add_request(Request(f"r{i}", p, {"temperature": 0.0}, max_tokens=10 + i, ignore_eos=True))
        done = run(sched, lambda so: w.execute_model(so).to_wire())
        results.append({rid: r.output_token_ids for rid, r in done.items()})
        assert sum(r.num_preemptions for r in done.values()) > 0
        assert max(r.num_cached_tokens for r in done.values()) > 0
        if ahead:
            assert w.runner.ahead_hits > 0 and w.runner.ahead_misses > 0
        assert w.runner.requests == {}
    assert results[0] == results[1]
    for i, p in enumerate(ps):
        assert results[0][f"r{i}"] == mlx_lm_greedy(oracle_model("builtin:tiny"), p, 10 + i)[0]


def test_decode_ahead_miss_uses_the_scheduler_token(make_worker) -> None:
    """When the scheduler states another token than the one sampled (new_token_ids), the
    precomputed forward is discarded and the stated token is computed."""
    outs = []
    for ahead in (True, False):
        w = make_worker(decode_ahead=ahead)
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("a", list(range(3, 20)))
        d.step(chunk=32)
        so = d.build(chunk=1)
        so["scheduled_cached_reqs"]["new_token_ids"] = [[77]]  # override the sampled token
        d.reqs["a"].out[-1] = 77
        d.commit(so, w.execute_model(so).to_wire())
        d.run(5)
        outs.append(d.reqs["a"].out)
        if ahead:
            assert w.runner.ahead_misses > 0
    assert outs[0] == outs[1]
