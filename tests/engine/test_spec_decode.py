"""Verification of scheduled drafts (engine/spec_decode.py) against plain decoding and mlx-lm."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from sidecar.errors import ProtocolError
from sidecar.engine.state import RequestState, Row
from sidecar.engine.sampler import Sampler, SamplingParams
from sidecar.engine.spec_decode import verify
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.spec_driver import SpecDriver
from tests.engine.test_model_runner import prompts

K = 3


def plain(w, ps: list[list[int]], n: int, sampling: dict | None = None) -> dict[str, list[int]]:
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    for i, p in enumerate(ps):
        d.add(f"p{i}", p, sampling)
    got = d.run(n, chunk=16)
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()
    return {rid.replace("p", "r"): t for rid, t in got.items()}


def close(w, d: SpecDriver) -> None:
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()
    assert not w.runner.requests


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen3"])
def test_right_and_wrong_drafts_give_mlx_lm_greedy_across_batching_chunks_and_preemption(
        make_worker, oracle_model, model: str) -> None:
    w = make_worker(model)
    ps = prompts(w.vocab_size(), [5, 23, 40], seed=7)
    want = {f"r{i}": mlx_lm_greedy(oracle_model(model), p, 16) for i, p in enumerate(ps)}
    truth = {rid: t for rid, (t, _) in want.items()}
    calls = [0]

    def drafts(r) -> list[int]:  # right, half right, or wrong, in turn
        calls[0] += 1
        right = truth[r.rid][len(r.out): len(r.out) + K]
        kind = calls[0] % 3
        return right if kind == 0 else right[:1] + [1, 2] if kind == 1 else [(t + 1) % w.vocab_size() for t in right]

    before = copy.copy(w.runner.spec)
    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, drafts)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, {"temperature": 0.0, "logprobs": 2})
    for _ in range(5):
        d.step(chunk=8)
    d.preempt("r1")
    d.step(chunk=8, only=["r0", "r2"])
    got = d.run(16, chunk=8)
    for rid, (toks, lps) in want.items():
        assert got[rid] == toks, rid
        np.testing.assert_allclose(d.reqs[rid].logprobs[:16], lps, atol=1e-4)
    accepted = w.runner.spec.accepted_tokens - before.accepted_tokens
    drafted = w.runner.spec.draft_tokens - before.draft_tokens
    assert 0 < accepted < drafted  # drafts were really accepted and really rejected
    assert max(max(s, default=0) for s in d.tokens_per_step) == K + 1
    # The worker's bookkeeping agrees with the scheduler's rollback.
    for rid, r in d.reqs.items():
        assert w.runner.requests[rid].num_computed_tokens == r.computed
        assert w.runner.requests[rid].output_token_ids == r.out
    close(w, d)


def test_always_wrong_gives_one_token_per_step_always_right_k_plus_one(make_worker) -> None:
    w = make_worker()
    ps = prompts(w.vocab_size(), [9, 17], seed=3)
    want = plain(w, ps, 13)
    for kind in ("wrong", "right"):
        def drafts(r, kind=kind) -> list[int]:
            right = want[r.rid][len(r.out): len(r.out) + K]
            return right if kind == "right" else [(t + 5) % w.vocab_size() for t in right]

        d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, drafts)
        for i, p in enumerate(ps):
            d.add(f"r{i}", p)
        got = d.run(13)
        assert got == want, kind
        sizes = {n for step in d.tokens_per_step[2:-1] for n in step}
        assert sizes == ({1} if kind == "wrong" else {K + 1}), (kind, d.tokens_per_step)
        close(w, d)


def test_drafts_mixed_with_plain_decode_rows_and_decode_ahead(make_worker) -> None:
    """Rows with and without drafts in one step; decode-ahead (on) must not be used for the rows
    whose next position moved by more than one."""
    w = make_worker()
    assert w.runner.decode_ahead
    ps = prompts(w.vocab_size(), [6, 11, 30], seed=9)
    want = plain(w, ps, 14)
    step = [0]

    def drafts(r) -> list[int]:
        step[0] += 1
        if r.rid == "r0" or step[0] % 4 == 0:
            return []
        return want[r.rid][len(r.out): len(r.out) + 1 + step[0] % 3]

    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, drafts)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p)
    hits = w.runner.ahead_hits
    assert d.run(14) == want
    assert w.runner.ahead_hits > hits  # the draft-free row still used the overlapped forward
    close(w, d)


@pytest.mark.parametrize("all_right", [False, True])
def test_a_verify_step_queues_the_next_decode_after_its_accepted_drafts(make_worker, oracle_model,
                                                                        all_right: bool) -> None:
    """After a step that verified drafts, a row with no new drafts has its next decode queued
    ahead at the position after its accepted drafts (partly right drafts: one accepted, one
    rejected; or both accepted), and the queued forward is what the next step uses: one ahead hit
    per such step, tokens still mlx-lm's. Control: with decode-ahead off, no hits."""
    ps = prompts(500, [9, 21], seed=4)
    want = {f"r{i}": mlx_lm_greedy(oracle_model("builtin:tiny"), p, 15)[0] for i, p in enumerate(ps)}
    hits = {}
    for ahead in (True, False):
        w = make_worker(decode_ahead=ahead)
        verified_then_plain, plain_after_plain = [0], [0]
        last_drafted: set[str] = set()

        def drafts(r) -> list[int]:
            if r.rid in last_drafted:  # verified in the last step: none now, so it decodes plainly
                last_drafted.discard(r.rid)
                verified_then_plain[0] += 1
                return []
            if len(r.out) < 10:  # drafts on every other step, then plain steps only
                last_drafted.add(r.rid)
                right = want[r.rid][len(r.out)]
                if all_right:
                    return want[r.rid][len(r.out): len(r.out) + 2]
                return [right, (right + 1) % 500]  # the first accepted, the second rejected
            plain_after_plain[0] += 1
            return []

        d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, drafts)
        for i, p in enumerate(ps):
            d.add(f"r{i}", p)
        before = w.runner.ahead_hits
        assert d.run(15) == want
        assert {n for step in d.tokens_per_step for n in step} == {3 if all_right else 2}  # accepted + 1
        hits[ahead] = (w.runner.ahead_hits - before, verified_then_plain[0], plain_after_plain[0])
        close(w, d)
    got, after_verify, after_plain = hits[True]
    assert after_verify >= 4 and got == after_verify + after_plain, hits  # each plain decode used a queued one
    assert hits[False][0] == 0, hits


def test_sampled_with_drafts_is_reproducible_per_seed(make_worker) -> None:
    w = make_worker()
    p = prompts(w.vocab_size(), [10], seed=11)[0]
    params = {"temperature": 0.8, "top_k": 50, "seed": 99, "logprobs": 1}

    def run(extra: int, seed: int = 99) -> list[int]:
        d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks,
                       lambda r: r.out[-2:] if r.rid == "s" and len(r.out) >= 2 else [])
        d.add("s", p, {**params, "seed": seed})
        for i, q in enumerate(prompts(w.vocab_size(), [4] * extra, seed=12)):
            d.add(f"o{i}", q, {"temperature": 1.0})
        out = d.run(12)["s"]
        close(w, d)
        return out

    drafted = w.runner.spec.draft_tokens
    a = run(0)
    assert w.runner.spec.draft_tokens > drafted
    assert run(2) == a  # other rows in the batch change nothing
    assert run(0, seed=100) != a  # the seed matters


def test_sampled_drafts_all_accepted_when_the_target_is_certain(make_worker) -> None:
    """logit_bias makes one token certain: a sampled row accepts that draft every time."""
    w = make_worker()
    p = prompts(w.vocab_size(), [8], seed=13)[0]
    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, lambda r: [42, 42])
    d.add("s", p, {"temperature": 1.0, "logit_bias": {42: 100.0}})
    got = d.run(9)["s"]
    assert got == [42] * 9
    assert {n for step in d.tokens_per_step[2:] for n in step} == {3}
    close(w, d)


# ---------------------------------------------------------------- validation


def _bad_steps(w):
    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7, 8])
    d.step()
    so = d.build(16)
    so["scheduled_spec_decode_tokens"] = {"a": [3, 4]}
    so["num_scheduled_tokens"]["a"] += 2
    so["total_num_scheduled_tokens"] += 2
    d._grow(d.reqs["a"], d.reqs["a"].known + 2)
    so["scheduled_cached_reqs"]["new_block_ids"] = [[d.reqs["a"].new_blocks]] if d.reqs["a"].new_blocks else [None]
    V = w.vocab_size()
    cases = {
        "scheduled_spec_decode_tokens.ghost": lambda s: s["scheduled_spec_decode_tokens"].update(ghost=[1]),
        "scheduled_spec_decode_tokens.a[1]": lambda s: s["scheduled_spec_decode_tokens"].update(a=[3, V]),
        "num_scheduled_tokens.a": lambda s: s["scheduled_spec_decode_tokens"].update(a=[3]),
        "scheduled_spec_decode_tokens.a": lambda s: s["scheduled_spec_decode_tokens"].update(a="x"),
    }
    return d, so, cases


def test_bad_drafts_are_rejected_with_the_field_and_change_nothing(make_worker) -> None:
    w = make_worker()
    d, good, cases = _bad_steps(w)
    state = w.runner.requests["a"]
    snap = (state.num_computed_tokens, list(state.output_token_ids), list(state.block_ids))
    for field, corrupt in cases.items():
        so = copy.deepcopy(good)
        corrupt(so)
        with pytest.raises(ProtocolError) as e:
            w.execute_model(so)
        assert e.value.field == field, (field, e.value)
        assert (state.num_computed_tokens, state.output_token_ids, state.block_ids) == snap
    res = w.execute_model(good).to_wire()  # the uncorrupted step still runs
    assert 1 <= len(res["sampled_token_ids"][0]) <= 3


# ---------------------------------------------------------------- the acceptance rule, statistically


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    exp = counts.sum() * p
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("dense", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(dense: bool) -> None:
    """Tiny vocabulary, fixed logits per position: the first returned token follows softmax of the
    target at position 0 and, when a draft was accepted, the second follows position 1, whatever
    the drafts are (a bad point mass, or drafts drawn from a wrong draft distribution q)."""
    V, N = 4, 6000
    p0, p1 = np.array([0.5, 0.25, 0.15, 0.1]), np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.1, 0.1, 0.2, 0.6])
    rng = np.random.default_rng(0)
    sampler = Sampler(V, [], seed=0)
    rows, probs = [], {}
    for i in range(N):
        d = rng.choice(V, size=2, p=q).tolist() if dense else [3, 3]
        s = RequestState(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i), [0])
        rows.append(Row(s, 0, [1] + d, [0], True, 2))
        if dense:
            probs[s.req_id] = np.tile(q, (2, 1))
    logits = mx.array(np.tile(np.log(np.stack([p0, p1, p1])), (N, 1)).astype(np.float32))
    out = verify(sampler, logits, rows, probs).token_ids
    first = np.bincount([t[0] for t in out], minlength=V)
    second = np.bincount([t[1] for t in out if len(t) > 1], minlength=V)
    crit = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert _chi2(first, p0) < crit and _chi2(second, p1) < crit, (first, second)
    # Negative control: taking the drafts as they come follows q (or the point mass), not p.
    naive = np.bincount([r.token_ids[1] for r in rows], minlength=V) + 1e-9
    assert _chi2(naive, p0) > 10 * crit
    # Seeded: the same rows verify to the same tokens.
    assert verify(sampler, logits[:600], rows[:200], probs).token_ids == out[:200]


def test_a_scheduler_that_skips_the_rollback_is_refused(make_worker) -> None:
    """Negative control for the rollback: counting rejected drafts as computed puts the next step
    past the known tokens, which the worker refuses (400) instead of reading their stale K/V."""
    w = make_worker()
    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, lambda r: [1, 2, 3])
    d.add("a", prompts(w.vocab_size(), [6], seed=21)[0])
    d.step()
    res = d.step()
    rejected = 3 - (len(res["sampled_token_ids"][0]) - 1)
    assert rejected > 0
    d.drafts = lambda r: []
    so = d.build(16)
    assert so["num_scheduled_tokens"] == {"a": 1}
    so["scheduled_cached_reqs"]["num_computed_tokens"][0] += rejected  # no rollback
    with pytest.raises(ProtocolError) as e:
        w.execute_model(so)
    assert e.value.field == "scheduled_cached_reqs.num_computed_tokens[0]"
    so["scheduled_cached_reqs"]["num_computed_tokens"][0] -= rejected  # rolled back: the same step runs
    assert len(w.execute_model(so).sampled_token_ids[0]) == 1


def test_corrupted_steps_with_drafts_are_rejected_cleanly(make_worker) -> None:
    """The fuzz test's corruptions on steps that carry drafts: accepted, or a 400 naming a field
    that changes nothing, and the valid step still runs."""
    import random

    from tests.engine.test_fuzz import _mutate, run_corrupted

    w = make_worker(num_blocks=256)
    rng = random.Random(99)

    def fresh() -> SpecDriver:
        if w.runner.requests:
            w.execute_model({"num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                             "finished_req_ids": list(w.runner.requests)})
        d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks,
                       lambda r: [rng.randrange(3, 500) for _ in range(rng.randrange(1, 4))])
        d.add("a", [rng.randrange(3, 500) for _ in range(9)], {"temperature": 0.8, "seed": 1, "logprobs": 1})
        d.add("b", [rng.randrange(3, 500) for _ in range(5)])
        d.step()
        return d

    d = fresh()
    tried = rejected = 0
    while tried < 100:
        if max(len(r.out) for r in d.reqs.values()) > 30:
            d = fresh()
        so = d.build(16)
        assert so["scheduled_spec_decode_tokens"]
        n, ran = run_corrupted(w, d, so, lambda: _mutate(so, rng))
        rejected, tried = rejected + n, tried + n + ran
        if ran:
            d = fresh()
    assert rejected > 40
