"""Speculative decoding: verifying scheduled drafts (vLLM v1 semantics; planner.py validates them).

A request with k drafts in `scheduled_spec_decode_tokens` computes its last known token plus the
k drafts in one forward (`num_scheduled_tokens` counts all k + 1); the logits at those k + 1
positions verify the drafts and give one more token, so a step returns 1..k+1 tokens per row.

- Greedy rows accept while the draft equals the argmax of the processed logits (penalties and
  masks see the accepted drafts as generated tokens), then add the argmax: exactly plain greedy.
- Sampled rows use rejection sampling: draft d at position j is accepted with probability
  min(1, p_j(d) / q_j(d)), where p is the target distribution after the whole sampling pipeline
  and q the draft distribution (a point mass for n-gram drafts, so min(1, p_j(d))). The first
  rejection samples from normalise(max(p_j - q_j, 0)); with every draft accepted the bonus is
  sampled from p_k. The output is distributed as plain sampling from p. Randomness is the
  sampler's stateless keyed noise, a function of (seed, output position) for seeded requests.

The K/V written for rejected drafts stays in the request's slots beyond its computed tokens,
where nothing reads it before the next step overwrites it (the scheduler rolls
`num_computed_tokens` back by the rejected count; the runner does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import mlx.core as mx
import numpy as np

from sidecar.engine.sampler import (_M32, _gather_logprobs, _gumbel_argmax, _splitmix64, _width, SamplingRow,
                                    greedy_tokens, truncate)

if TYPE_CHECKING:
    from sidecar.engine.state import Row
    from sidecar.engine.sampler import Sampler

_U_SALT = 0x5851F42D4C957F2D  # separates the acceptance uniforms from the Gumbel noise stream


@dataclass
class Verified:
    token_ids: list[list[int]]  # per row: accepted drafts + the bonus/corrected token ([] for chunk rows)
    logprob_token_ids: list[list[int]] | None  # one row per returned token, flattened over rows
    logprobs: list[list[float]] | None
    sampled_token_ranks: list[int] | None
    cu_num_generated_tokens: list[int]  # [0, n_0, n_0 + n_1, ...]
    num_nans: list[int]
    num_draft: int = 0
    num_accepted: int = 0


@dataclass
class SpecCounters:
    """Totals since start, read by the metrics (plain ints, replaced atomically)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_with_drafts: int = 0


def _uniform(key: int) -> float:
    return ((_splitmix64(key ^ _U_SALT) >> 40) + 0.5) * 2.0**-24


def verify(sampler: Sampler, logits: mx.array, rows: Sequence[Row],
           draft_probs: Mapping[str, np.ndarray] | None = None) -> Verified:
    """`logits`: [sum over rows of (num_draft + 1), V], each row's positions in order."""
    N, V = logits.shape
    srows: list[SamplingRow] = []
    nxt: list[int] = []  # per position: the draft it verifies, -1 at a row's last position
    base: list[int] = []
    for r in rows:
        k = r.num_draft
        drafts = r.token_ids[len(r.token_ids) - k:] if k else []
        outs = list(r.state.output_token_ids)
        base.append(len(srows))
        for j in range(k + 1):
            srows.append(SamplingRow(r.state.sampling_params, r.state.prompt_token_ids, outs + drafts[:j]))
            nxt.append(drafts[j] if j < k else -1)
    assert len(srows) == N, (len(srows), N)
    ps = [s.params for s in srows]
    x = logits.astype(mx.float32)
    out: dict[str, mx.array] = {"nans": mx.isnan(x).sum(-1)}
    asks = [_width(p.logprobs, V) for p in ps if p.logprobs is not None]
    raw = x - mx.logsumexp(x, axis=-1, keepdims=True) if asks else None
    x = sampler.process_logits(x, srows)
    out["argmax"] = greedy_tokens(x.astype(logits.dtype))
    rand = np.array([not p.greedy for p in ps])
    keys: list[int] = []
    if rand.any():
        keys = [sampler._key(s) if g else 0 for s, g in zip(srows, rand)]
        out.update(_rejection_inputs(x, srows, rand, nxt, keys, rows, base, draft_probs or {}))
    mx.eval(out)
    res = {k: v.tolist() for k, v in out.items()}

    tokens: list[list[int]] = []
    n_draft = n_acc = 0
    for i, r in enumerate(rows):
        if not r.sample:
            tokens.append([])
            continue
        b, k = base[i], r.num_draft
        toks: list[int] = []
        for j in range(k + 1):
            at = b + j
            if not rand[at]:
                pick = res["argmax"][at]
            elif j == k:
                pick = res["rec"][at]  # the bonus: plain sampling from p_k
            else:
                pd, qd = res["pd"][at], res["qd"][at]
                pick = nxt[at] if qd > 0 and _uniform(keys[at]) < pd / qd else res["rec"][at]
            toks.append(int(pick))
            if j == k or pick != nxt[at]:
                break
        n_draft += k
        n_acc += len(toks) - 1
        tokens.append(toks)

    cu = [0]
    for t in tokens:
        cu.append(cu[-1] + len(t))
    ids = lps = ranks = None
    if raw is not None and cu[-1]:
        pos = [base[i] + j for i, t in enumerate(tokens) for j in range(len(t))]
        flat = mx.array(np.asarray([tok for t in tokens for tok in t], np.int32))
        g = _gather_logprobs(raw[mx.array(np.asarray(pos, np.int32))], flat, max(asks))
        mx.eval(g)
        ids, lps, ranks = (a.tolist() for a in g)
    nans = [int(sum(res["nans"][base[i]: base[i] + r.num_draft + 1])) for i, r in enumerate(rows)]
    return Verified(tokens, ids, lps, ranks, cu, nans, n_draft, n_acc)


def _rejection_inputs(x: mx.array, srows: list[SamplingRow], rand: np.ndarray, nxt: list[int], keys: list[int],
                      rows: Sequence[Row], base: list[int], draft_probs: Mapping[str, np.ndarray]) -> dict:
    """For every position: p(draft), q(draft), and a sample from the residual (the bonus
    position: from p itself), all in one lazy graph. Greedy positions get dummies."""
    N, V = x.shape
    ps = [s.params for s in srows]
    temp = mx.array([p.temperature if r else 1.0 for p, r in zip(ps, rand)], mx.float32)[:, None]
    col = lambda name, off: np.where(rand, [getattr(p, name) for p in ps], off)  # noqa: E731
    min_p, top_k, top_p = col("min_p", 0.0), col("top_k", V), col("top_p", 1.0)
    top_k = np.where((top_k > 0) & (top_k < V), top_k, V)
    s = truncate(x / temp, min_p if min_p.any() else None, top_k if (top_k < V).any() else None,
                 top_p if (top_p < 1).any() else None)
    probs = mx.softmax(s, axis=-1)
    lanes = mx.arange(V, dtype=mx.uint32)[None]
    d = np.asarray([max(t, 0) for t in nxt], np.int32)
    has = np.asarray([t >= 0 for t in nxt])
    q = ((lanes == mx.array(d.astype(np.uint32))[:, None]) & mx.array(has)[:, None]).astype(mx.float32)
    dense = [(i, r) for i, r in enumerate(rows) if r.num_draft and r.state.req_id in draft_probs]
    if dense:  # draft-model rows: their proposal distributions replace the point masses
        at = np.concatenate([np.arange(base[i], base[i] + r.num_draft) for i, r in dense])
        qs = np.concatenate([np.asarray(draft_probs[r.state.req_id], np.float32)[: r.num_draft] for _, r in dense])
        q[mx.array(at.astype(np.int32))] = mx.array(qs)
    resid = mx.maximum(probs - q, 0.0)
    target = mx.where(mx.array(has)[:, None], mx.where(resid > 0, mx.log(resid), -mx.inf), s)
    k1 = mx.array([k & _M32 for k in keys], mx.uint32)[:, None]
    k2 = mx.array([k >> 32 for k in keys], mx.uint32)[:, None]
    dcol = mx.array(d)[:, None]
    return {"rec": _gumbel_argmax(target, lanes, k1, k2).astype(mx.int32),
            "pd": mx.take_along_axis(probs, dcol, axis=-1)[:, 0], "qd": mx.take_along_axis(q, dcol, axis=-1)[:, 0]}
