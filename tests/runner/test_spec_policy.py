"""runner/spec_policy.py: drafting only where the expected tokens per step beat the verify cost."""

from __future__ import annotations

import random

import mlx.core as mx

from sidecar.runner.spec_policy import VerifyCost, acceptance, best_length, measure
from tests.conftest import mlx_lm_greedy
from tests.runner.test_proposers import _repeating, _run


def test_best_length_weighs_acceptance_against_cost() -> None:
    reference, openblas = VerifyCost(0.79), VerifyCost(0.06)  # builtin:small's, measured (README)
    assert best_length(4, 0.5, reference) == 0  # 1.5 tokens for 1.79 steps: never
    assert best_length(4, acceptance(0, 0), reference) == 0  # a new request (rate 2/3)
    assert best_length(4, acceptance(0, 0), openblas) == 4
    assert best_length(4, 0.95, reference) >= 1  # near-certain drafts still pay a little
    assert best_length(4, 0.47, openblas) == 3  # random text, optimised BLAS: the 4th draft adds 0.05 for 0.06
    assert best_length(4, 0.91, openblas) == 4  # repetitive text: all k
    assert best_length(4, 0.1, openblas) == 1  # a rare hit: one cheap draft
    assert best_length(4, 0.0, openblas) == 0 and best_length(0, 1.0, VerifyCost(0.0)) == 0
    assert best_length(3, 0.2, VerifyCost(0.0)) == 3  # free verification: every draft
    assert acceptance(9, 10) == 11 / 13 and acceptance(0, 7) == 0.2


def test_measure_tells_a_cost_per_row_from_a_cost_per_step() -> None:
    w = mx.random.normal((384, 384), key=mx.random.key(0))

    def per_row(x: mx.array) -> mx.array:  # the reference BLAS: every row another matmul
        return sum(mx.sum(w @ w) for _ in range(x.shape[1]))

    def per_step(x: mx.array) -> mx.array:  # one matmul whatever the rows
        return mx.sum(w @ w) + x.sum()

    assert measure(per_row, 4, reps=5).extra > 0.5
    assert measure(per_step, 4, reps=5).extra < 0.3


def test_a_costly_verify_drafts_nothing_and_samples_lazily(make_worker, oracle_model) -> None:
    """With a verify cost as the reference BLAS gives a large model, the n-gram proposer drafts
    nothing even on text it would copy, and the steps run as without a proposer (lazy sampling);
    the control (free verification) drafts and accepts. Greedy output is mlx-lm's either way."""
    prompt = _repeating(500, 3, period=5, times=5)
    want = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 16)[0]
    seen = {}
    for extra in (1.0, 0.0):
        w = make_worker(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                        prompt_lookup_max=4)
        w.runner.proposer.cost = VerifyCost(extra)
        calls = []
        sample = w.runner.sampler.sample
        w.runner.sampler.sample = lambda *a, **k: calls.append(1) or sample(*a, **k)
        before = w.runner.spec.draft_tokens, w.runner.spec.accepted_tokens
        got, _ = _run(w, {"a": prompt}, 16)
        assert got["a"] == want, extra
        seen[extra] = (w.runner.spec.draft_tokens - before[0], w.runner.spec.accepted_tokens - before[1], len(calls))
    assert seen[1.0] == (0, 0, 0), seen
    assert seen[0.0][1] > 0, seen


def test_the_ngram_proposer_measures_its_model_once(make_worker) -> None:
    w = make_worker(speculative_method="ngram", prompt_lookup_min=1)
    p = w.runner.proposer
    assert p.cost is None
    rng = random.Random(1)
    _run(w, {"a": [rng.randrange(3, 500) for _ in range(6)] * 2}, 4)
    cost = p.cost
    assert cost is not None and 0.0 <= cost.extra < 10
    _run(w, {"b": [5, 6, 7] * 3}, 3)
    assert p.cost is cost
