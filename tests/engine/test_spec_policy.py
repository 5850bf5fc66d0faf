"""engine/spec_policy.py: drafting only where the expected tokens per step beat the verify cost."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Callable

import mlx.core as mx
import pytest

from sidecar.engine import spec_policy
from sidecar.engine.spec_policy import VerifyCost, acceptance, best_length, measure
from tests.conftest import mlx_lm_greedy
from tests.engine.test_proposers import _repeating, _run


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


def test_measure_tells_a_cost_per_row_from_a_cost_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock the forwards advance (no wall-clock threshold to miss on a busy machine): a
    forward costing a unit per row verifies k drafts at k extra units, one costing a unit per
    step at none, and a slowed run (another process on the core) does not count: the fastest
    of the interleaved runs does."""
    now = [0.0]
    monkeypatch.setattr(spec_policy, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    runs: list[int] = []

    def forward(per_row: bool, slow_runs: set[int]) -> Callable[[mx.array], mx.array]:
        def run(x: mx.array) -> mx.array:
            rows = x.shape[1]
            runs.append(rows)
            now[0] += (rows if per_row else 1.0) + (100.0 if len(runs) in slow_runs else 0.0)
            return x.sum()
        return run

    assert measure(forward(True, set()), 4, reps=5).extra == 1.0
    assert runs == [1, 5] + [1, 5] * 5  # the shapes' first use untimed, then interleaved
    runs.clear()
    assert measure(forward(False, set()), 4, reps=5).extra == 0.0
    runs.clear()
    assert measure(forward(True, {3, 6, 8}), 4, reps=3).extra == 1.0  # slowed runs of both shapes
    runs.clear()
    assert measure(forward(False, {4, 5}), 2, reps=2).extra == 0.0


def test_a_costly_verify_drafts_nothing_and_samples_lazily(make_worker, oracle_model) -> None:
    """With a verify cost as the reference BLAS gives a large model, the n-gram proposer drafts
    nothing even on text it would copy, and the steps run as without a proposer (lazy sampling);
    the control (free verification) drafts and accepts. Greedy output is mlx-lm's either way."""
    prompt = _repeating(500, 3, period=5, times=5)
    want = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 16)[0]
    seen = {}
    for extra in (1.0, 0.0):
        w = make_worker(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                        prompt_lookup_max=4, speculative_verify_cost=extra)  # given: not timed
        assert w.runner.proposer.cost == VerifyCost(extra)
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
