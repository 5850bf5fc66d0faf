"""When drafting pays: the cost of verifying j drafts against the tokens they can be expected to give.

A step verifying j drafts computes j + 1 tokens per row. On a GPU, or on a CPU with an optimised
BLAS, that costs little more than one decode step; with the reference BLAS the mlx[cpu] Linux
wheel bundles every matmul row costs the same again, so j drafts cost about j + 1 decode steps and
cannot pay even when all are accepted (docs/performance.md). The n-gram
proposer measures that cost once on the model (a forward of 1 and of k + 1 tokens, best of 5,
no cache: the matmuls a verify step adds), counts each request's accepted drafts, and drafts j
tokens only where the expected tokens per step, 1 + a + .. + a^j at acceptance rate a, beat the
step's relative cost 1 + extra * j. The cost leaves out what a step costs whatever it computes (the
round trip, the scheduler), so it errs towards not drafting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True)
class VerifyCost:
    extra: float  # the cost of each verified draft token, relative to a one-token step

    def of(self, j: int) -> float:
        return 1.0 + self.extra * j


def measure(model: Any, k: int, reps: int = 5) -> VerifyCost:
    """The model's verify cost at k drafts: forwards of 1 and k + 1 tokens, interleaved, the
    fastest of each (a shared machine only ever makes a run slower)."""
    shapes = (1, k + 1)
    best = dict.fromkeys(shapes, math.inf)
    xs = {n: mx.zeros((1, n), mx.int32) for n in shapes}
    for n in shapes:
        mx.eval(model(xs[n]))  # first use of a shape: allocation, not compute
    for _ in range(reps):
        for n in shapes:
            t0 = time.perf_counter()
            mx.eval(model(xs[n]))
            best[n] = min(best[n], time.perf_counter() - t0)
    return VerifyCost(max(0.0, (best[k + 1] / best[1] - 1.0) / max(1, k)))


def acceptance(accepted: int, drafted: int) -> float:
    """A request's draft acceptance rate, with two accepted drafts and one rejected assumed first:
    a new request starts at 2/3, where k drafts pay on an optimised BLAS and none on the reference one."""
    return (accepted + 2) / (drafted + 3)


def best_length(limit: int, rate: float, cost: VerifyCost) -> int:
    """The number of drafts (0 .. limit) with the most expected tokens per unit of step cost; 0
    unless drafting beats a plain decode step."""
    best_j, best = 0, 1.0
    expected = 1.0
    for j in range(1, limit + 1):
        expected += rate**j
        gain = expected / cost.of(j)
        if gain > best:
            best_j, best = j, gain
    return best_j
