"""Speculative decoding scenario: tokens/s of one greedy stream with the worker's n-gram proposer
(a second server, `--speculative-method ngram`, drafts taken with take_draft_token_ids as vLLM's
engine does) against the plain server, on repetitive text (where lookup can win) and on random
text (where it cannot, and must not cost much).

The built-in models have random weights: they never copy a real text. What they do is fall into
repeating a token after some contexts, so the repetitive prompt is one token repeated, picked from
a few candidates by how repetitive the plain greedy output after it is (a short probe run, the
candidates and scores are recorded). The acceptance rate of each case is measured and reported,
with the step time on and off. With the reference BLAS the mlx[cpu] wheel bundles, every matmul
costs in proportion to its rows (the LM head: 7 ms per row on builtin:small), so verifying k
drafts costs about k + 1 decode steps and speculation cannot win; with an optimised BLAS
(OpenBLAS preloaded) or on a GPU a 4-token verify costs about one decode step, and it pays.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np

from bench import blas
from bench.sides import RunResult, SidecarSide, requests_for
from sidecar.engine.ngram import ngram_drafts
from sidecar.scheduler import Event

CASES = ("repetitive", "random")


def lookup_tokens_per_step(context: list[int], out: list[int], k: int, n_min: int, n_max: int) -> float:
    """Greedy tokens per step n-gram speculation would give on this output (no model needed)."""
    i = steps = 0
    while i < len(out):
        d = ngram_drafts(np.asarray(context + out[:i], np.int32), n_min, n_max, k)[: len(out) - i - 1]
        a = 0
        while a < len(d) and d[a] == out[i + a]:
            a += 1
        i, steps = i + a + 1, steps + 1
    return len(out) / max(1, steps)


def _timed(side: SidecarSide, prompt: list[int], n: int, tag: str, drafts: bool) -> tuple[RunResult, Any, list]:
    events: list[tuple[float, int]] = []

    def on_event(e: Event, now: float) -> None:
        events.append((now, len(e.new_token_ids)))

    res, sched = side.run(requests_for([prompt], n), tag=tag, on_event=on_event, take_drafts=drafts)
    return res, sched, events


def _rate(events: list[tuple[float, int]]) -> float:
    """Tokens/s after the first token (prefill excluded), counting every token of a multi-token step."""
    if len(events) < 2 or events[-1][0] <= events[0][0]:
        return float("nan")
    return (sum(n for _, n in events) - events[0][1]) / (events[-1][0] - events[0][0])


def _fast_blas_env() -> dict[str, str] | None:
    """The environment for servers on an installed OpenBLAS, when this process is on the bundled
    BLAS and one is installed (bench/blas.py); None otherwise (already on it, or none)."""
    lib = blas.find_openblas() if sys.platform.startswith("linux") else None
    if lib is None or lib in os.environ.get("LD_PRELOAD", "").split():
        return None
    return blas.preload_env({}, lib)


def speculative(b: Any, make_side: Callable[..., SidecarSide]) -> None:
    """Both cases on this process's BLAS; and, where this process is on the bundled reference BLAS
    and an OpenBLAS is installed, again on two servers that preload it (plain and n-gram, the
    same BLAS on both sides). The headline ratios are then the optimised BLAS's: on the reference
    BLAS a (k+1)-row verify costs k+1 decode steps, no speculation can pay there and the policy
    keeps it off (the `_bundled` figures show that)."""
    p = b.params
    k, lo, hi = p.spec_k, p.spec_lookup_min, p.spec_lookup_max
    ngram = {"speculative_method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
             "prompt_lookup_max": hi}
    side = make_side(ngram)
    side.run(requests_for([b.prompt(8)], p.warmup_new_tokens), tag="spec_warmup", take_drafts=True)
    # The repetitive prompt: the candidate whose plain greedy continuation repeats most.
    scores = {}
    for t in b.rng.integers(3, 500, size=p.spec_candidates).tolist():
        cand = [t] * p.spec_prompt_len
        out = b.sidecar.run(requests_for([cand], p.spec_probe_tokens), tag="spec_probe")[0]
        scores[t] = lookup_tokens_per_step(cand, next(iter(out.tokens.values())), k, lo, hi)
    best = max(scores, key=lambda t: scores[t])
    prompts = {"repetitive": [best] * p.spec_prompt_len, "random": b.prompt(p.spec_prompt_len)}
    b.raw["spec_probe_scores"] = scores
    b.results["spec_repetitive_token"] = best
    env = _fast_blas_env()
    # Whether the `_bundled` figures exist: only with an OpenBLAS to compare the bundled BLAS with.
    b.results["spec_openblas_pair"] = env is not None
    if env is None:
        _cases(b, prompts, side, b.sidecar, "")
        b.results["spec_blas"] = blas.label(blas.describe())
        b.results["spec_blas_short"] = blas.describe()["name"]
    else:
        _cases(b, prompts, side, b.sidecar, "_bundled")
        fast_on, fast_off = make_side(ngram, env=env), make_side({}, env=env)
        for s in (fast_on, fast_off):
            s.run(requests_for([b.prompt(8)], p.warmup_new_tokens), tag="spec_warmup", take_drafts=True)
        _cases(b, prompts, fast_on, fast_off, "")
        b.results["spec_blas"] = f"OpenBLAS ({env['LD_PRELOAD']}, {env[blas.THREADS_ENV]} thread)"
        b.results["spec_blas_short"] = "OpenBLAS"
    b.results.update(spec_k=k, spec_new_tokens=p.spec_new_tokens)


def _cases(b: Any, prompts: dict[str, list[int]], side: SidecarSide, plain: SidecarSide, suffix: str) -> None:
    """Each case, `side` (n-gram) against `plain`, pairs alternating: figures `spec_<case>_*<suffix>`."""
    p = b.params
    k = p.spec_k
    for case in CASES:
        prompt = prompts[case]
        rates: dict[str, list[float]] = {"on": [], "off": []}
        ratios, match, acc, per_step = [], [], [], []
        for i in range(p.spec_repeats):
            got = {}
            for which in (("off", "on") if i % 2 == 0 else ("on", "off")):
                s = side if which == "on" else plain
                res, sched, events = _timed(s, prompt, p.spec_new_tokens, f"spec_{case}_{which}{suffix}", which == "on")
                got[which] = next(iter(res.tokens.values()))
                rates[which].append(_rate(events))
                if which == "on":
                    acc.append(sched.num_accepted_tokens / sched.num_draft_tokens if sched.num_draft_tokens else 0.0)
                    per_step.append(len(got["on"]) / len(events))
            match.append(float(got["on"] == got["off"]))
            ratios.append(rates["on"][-1] / rates["off"][-1])
            b.log(f"speculative {case}{suffix} {i + 1}/{p.spec_repeats}: on {rates['on'][-1]:.2f} tok/s, off "
                  f"{rates['off'][-1]:.2f} tok/s, acceptance {acc[-1]:.0%}, {per_step[-1]:.2f} tokens/step")
        med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
        b.results.update({
            f"spec_{case}_ratio{suffix}": med(ratios), f"spec_{case}_on_tok_s{suffix}": med(rates["on"]),
            f"spec_{case}_off_tok_s{suffix}": med(rates["off"]), f"spec_{case}_acceptance{suffix}": med(acc),
            f"spec_{case}_tokens_per_step{suffix}": med(per_step), f"spec_{case}_tokens_match{suffix}": min(match),
        })
        b.raw[f"spec_{case}_pair_ratios{suffix}"] = ratios
        # Why the ratio is what it is: the step time with k + 1 tokens to verify against one token.
        for which, w in (("on", side.worker), ("off", plain.worker)):
            steps = [r for r in w.records if r.tag == f"spec_{case}_{which}{suffix}" and r.rows == 1
                     and r.tokens <= k + 1]
            b.results[f"spec_{case}_step_ms_{which}{suffix}"] = med([r.client_s * 1e3 for r in steps])
            b.results[f"spec_{case}_scheduled_tokens_per_step_{which}{suffix}"] = med([r.tokens for r in steps])
