"""Batched per-row sampling with vLLM v1 semantics, as one lazy MLX graph per step.

Order (as vLLM's sampler): allowed_token_ids -> bad words -> min_tokens -> logit_bias ->
repetition/frequency/presence penalties -> greedy argmax | temperature -> min_p -> top_k ->
top_p -> draw. Logprobs are of the raw logits (vLLM's default ``raw_logprobs``).

Randomness is stateless: row r's noise at vocab index v is a uint32 hash of (key_r, v), where
key_r is derived from (seed, number of tokens generated so far) for seeded requests, so a seeded
request draws the same tokens whatever else is in the batch and after a preemption. The draw is
Gumbel-max over the kept set: a sample from its softmax (exact up to the 24-bit uniforms), with
no sort. Work no row needs is skipped: masks, penalties, the sort for top-k/top-p, the noise.
The graph is evaluated once, except that on the CPU backend the top-k/top-p sort runs in numpy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import mlx.core as mx
import numpy as np

from sidecar.wire.sampling_params import SamplingParams  # noqa: F401  (re-exported: the wire type lives there)

_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the step's logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (before this step's sample)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprob_token_ids: list[list[int]] | None  # [rows][k+1]: sampled token, then the top-k
    logprobs: list[list[float]] | None
    sampled_token_ranks: list[int] | None  # vLLM: number of tokens with logprob >= the sampled one's
    num_nans: list[int]


# ---------------------------------------------------------------- MLX kernels (elementwise ops fuse)


@partial(mx.compile, shapeless=True)
def _penalize(x, out_counts, prompt_counts, rep, freq, pres):
    r = mx.where(out_counts + prompt_counts > 0, rep, 1.0)
    x = mx.where(x > 0, x / r, x * r)
    return x - freq * out_counts - pres * (out_counts > 0)


def _fmix32(z):
    z = (z ^ (z >> 16)) * 0x85EBCA6B
    z = (z ^ (z >> 13)) * 0xC2B2AE35
    return z ^ (z >> 16)


@partial(mx.compile, shapeless=True)
def _gumbel_argmax(s, lanes, k1, k2):
    """argmax(s + Gumbel noise); noise[r, v] = hash(k1[r], k2[r], v) -> uniform -> Gumbel."""
    z = _fmix32((lanes ^ k1) * 0x9E3779B9 + k2)
    u = ((z >> 8).astype(mx.float32) + 0.5) * (2.0**-24)
    return mx.argmax(s - mx.log(-mx.log(u)), axis=-1)


def truncate(s: mx.array, min_p: np.ndarray | None = None, top_k: np.ndarray | None = None,
             top_p: np.ndarray | None = None) -> mx.array:
    """min_p, then top_k, then top_p (vLLM order) on temperature-scaled logits [R, V]; dropped -> -inf.

    Per-row parameters (None: no row uses it): min_p [R] (0 = off), top_k [R] in [1, V] (V = off),
    top_p [R] in (0, 1] (1 = off). Tokens are dropped below a per-row threshold, so a token tied
    with the last kept one is kept too (vLLM drops by sorted position; only exact ties differ).
    """
    if min_p is not None:  # prob < min_p * max prob  <=>  s < max(s) + log(min_p)
        with np.errstate(divide="ignore"):
            log_min_p = mx.array(np.log(min_p, dtype=np.float32))[:, None]
        s = mx.where(s < s.max(-1, keepdims=True) + log_min_p, -mx.inf, s)
    if top_k is None and top_p is None:
        return s
    R, V = s.shape
    k = np.full(R, V, np.int32) if top_k is None else top_k.astype(np.int32)
    p = np.ones(R, np.float32) if top_p is None else top_p.astype(np.float32)
    rows = np.flatnonzero((k < V) | (p < 1))  # only these rows are sorted
    if mx.default_device() == mx.cpu:  # MLX's CPU sort is ~20x slower than numpy's
        thr = np.full((R, 1), -np.inf, np.float32)
        thr[rows] = _thresholds_np(np.array(s)[rows], k[rows], p[rows])
        thr = mx.array(thr)
    else:
        idx = mx.array(rows)
        thr = mx.full((R, 1), -mx.inf, mx.float32)
        thr[idx] = _thresholds_mx(s[idx], mx.array(k[rows]), mx.array(p[rows]))
    return mx.where(s < thr, -mx.inf, s)


def _thresholds_mx(s: mx.array, k: mx.array, p: mx.array) -> mx.array:
    """[R, 1] smallest kept logit under top_k then top_p (vLLM: ascending sort, cumsum <= 1 - p)."""
    V = s.shape[-1]
    srt = mx.sort(s, axis=-1)
    thr = mx.take_along_axis(srt, (V - k)[:, None], axis=-1)
    srt = mx.where(srt < thr, -mx.inf, srt)
    cum = mx.cumsum(mx.softmax(srt, axis=-1), axis=-1)
    cut = mx.minimum((cum <= 1 - p[:, None]).sum(-1, keepdims=True), V - 1)  # always keep the top
    return mx.take_along_axis(srt, cut.astype(mx.int32), axis=-1)


def _thresholds_np(s: np.ndarray, k: np.ndarray, p: np.ndarray) -> np.ndarray:
    """numpy twin of _thresholds_mx (top-k-dropped tokens get probability 0 instead of -inf logits)."""
    V = s.shape[-1]
    srt = np.sort(s, axis=-1)
    thr = np.take_along_axis(srt, (V - k)[:, None], axis=-1)
    with np.errstate(invalid="ignore"):  # rows that are all -inf
        e = np.exp(srt - srt[:, -1:]) * (srt >= thr)
        cum = np.cumsum(e / e.sum(-1, keepdims=True), axis=-1)
    cut = np.minimum((cum <= 1 - p[:, None]).sum(-1, keepdims=True), V - 1)
    return np.take_along_axis(srt, cut, axis=-1)


def _gather_logprobs(lp: mx.array, ids: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """[N, 1 + k] ids and logprobs (column 0 = ids, then the top-k, best first) and ranks of ids."""
    tok_lp = mx.take_along_axis(lp, ids[:, None], axis=-1)
    ranks = (lp >= tok_lp).sum(-1)
    if k == 0:
        return ids[:, None], tok_lp, ranks
    if k >= lp.shape[-1]:
        top = mx.argsort(-lp, axis=-1)
    else:
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(lp, top, axis=-1), axis=-1), axis=-1)
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    return mx.concatenate([ids[:, None], top.astype(ids.dtype)], 1), mx.concatenate([tok_lp, top_lp], 1), ranks


def plain_greedy(p: SamplingParams, num_outputs: int) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs: argmax is the whole sampler."""
    return (p.greedy and not p.has_penalties and not p.logit_bias and not p.allowed_token_ids
            and not p.bad_words_token_ids and p.logprobs is None and num_outputs >= p.min_tokens)


def greedy_tokens(logits: mx.array) -> mx.array:
    """mlx-lm's greedy pick: the argmax of its logprobs, `logits - logsumexp(logits)` in the logits'
    own dtype. In bf16/fp16 that subtraction rounds logits a few ulps apart to one logprob (the
    first then wins), so the argmax of the logits themselves picks another token in near-ties.
    float32 logits take the plain argmax: there the subtraction merges only logits ~1e-7 apart,
    and the logsumexp costs ~10 ns per vocabulary entry on the CPU (1.5 ms at 150k)."""
    if logits.dtype == mx.float32:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).astype(mx.int32)


def _width(k: int, V: int) -> int:
    return V if k == -1 else min(k, V)


def prompt_logprobs(
    logits: mx.array, target_ids: Sequence[int], k: int
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """For each position i: column 0 = target_ids[i] and its logprob, then the top-k; plus ranks."""
    if len(target_ids) == 0:
        return [], [], []
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    ids, lps, ranks = _gather_logprobs(lp, mx.array(np.asarray(target_ids, np.int32)), _width(k, x.shape[-1]))
    mx.eval(ids, lps, ranks)
    return ids.tolist(), lps.tolist(), ranks.tolist()


# ---------------------------------------------------------------- the sampler


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _ids(rows_tokens: list[tuple[int, np.ndarray]], V: int) -> tuple[mx.array, mx.array]:
    """Flat (row, token) index arrays for a scatter; ids outside [0, V) are dropped."""
    r = np.concatenate([np.full(len(t), i, np.int32) for i, t in rows_tokens])
    t = np.concatenate([t for _, t in rows_tokens]).astype(np.int32, copy=False)
    ok = (t >= 0) & (t < V)
    return mx.array(r[ok]), mx.array(t[ok])


def _counts(rows_tokens: list[tuple[int, np.ndarray]], R: int, V: int) -> mx.array:
    if not rows_tokens:
        return mx.zeros((R, V), mx.float32)
    r, t = _ids(rows_tokens, V)
    return mx.zeros((R, V), mx.float32).at[r, t].add(1.0)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._rng = random.Random(seed)
        self._lanes: mx.array | None = None
        self._prompts: dict[int, tuple[Sequence[int], int, np.ndarray]] = {}  # id -> (seq, len, unique ids)
        self._biases: dict[int, tuple[SamplingParams, np.ndarray, np.ndarray]] = {}  # id(params) -> logit_bias arrays

    def sample(self, logits: mx.array, rows: Sequence[SamplingRow]) -> SampleResult:
        R, V = logits.shape
        assert len(rows) == R, (len(rows), R)
        if R == 0:
            return SampleResult([], None, None, None, [])
        ps = [r.params for r in rows]
        x = logits.astype(mx.float32)
        out = {"nans": mx.isnan(x).sum(-1)}
        asks = [_width(p.logprobs, V) for p in ps if p.logprobs is not None]
        raw = x - mx.logsumexp(x, axis=-1, keepdims=True) if asks else None
        x = self.process_logits(x, rows)
        tok = greedy_tokens(x.astype(logits.dtype))  # unprocessed rows: the logits as they were
        if not all(p.greedy for p in ps):
            drawn = self._draw(x, rows)
            tok = mx.where(mx.array([p.greedy for p in ps]), tok, drawn.astype(mx.int32))
        out["tok"] = tok
        if raw is not None:
            out["ids"], out["lps"], out["ranks"] = _gather_logprobs(raw, tok, max(asks))
        mx.eval(out)
        res = {k: v.tolist() for k, v in out.items()}
        return SampleResult(res["tok"], res.get("ids"), res.get("lps"), res.get("ranks"), res["nans"])

    def process_logits(self, x: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
        """Everything before the greedy argmax: token masks, logit_bias and penalties ([R, V] f32)."""
        R, V = x.shape
        x = x.astype(mx.float32)
        ps = [r.params for r in rows]
        cache, self._prompts = self._prompts, {}  # prompt ids of the requests still running
        # allowed_token_ids: the row starts at -inf and its allowed ids are raised back to 0.
        allowed = [(i, np.asarray(p.allowed_token_ids)) for i, p in enumerate(ps) if p.allowed_token_ids]
        # bad words, min_tokens (-inf) and logit_bias: one scatter-add.
        adds: list[tuple[int, int, float]] = []
        biases: list[tuple[int, np.ndarray, np.ndarray]] = []
        bias_cache, self._biases = self._biases, {}
        for i, (r, p) in enumerate(zip(rows, ps)):
            if p.bad_words_token_ids:
                adds += [(i, t, -math.inf) for t in _bad_words(p.bad_words_token_ids, r.output_token_ids)]
            if len(r.output_token_ids) < p.min_tokens:
                adds += [(i, t, -math.inf) for t in (p.stop_token_ids or ()) + (self.eos_token_ids if p.adds_eos else ())]
            if p.logit_bias:
                biases.append((i, *self._bias_arrays(p, V, bias_cache)))
        adds = [a for a in adds if 0 <= a[1] < V]
        if adds or biases:
            r_, t_, b_ = zip(*adds) if adds else ((), (), ())
            rr = np.concatenate([np.asarray(r_, np.int32)] + [np.full(len(t), i, np.int32) for i, t, _ in biases])
            tt = np.concatenate([np.asarray(t_, np.int32)] + [t for _, t, _ in biases])
            bb = np.concatenate([np.asarray(b_, np.float32)] + [b for _, _, b in biases])
        if allowed or adds or biases:
            adj = mx.zeros((R, V), mx.float32)
            if allowed:
                col = mx.array([-math.inf if p.allowed_token_ids else 0.0 for p in ps])[:, None]
                adj = (adj + col).at[_ids(allowed, V)].maximum(0.0)
            if adds or biases:
                adj = adj.at[mx.array(rr), mx.array(tt)].add(mx.array(bb))
            x = x + adj
        pen = [i for i, p in enumerate(ps) if p.has_penalties]
        if pen:
            outs = [(i, np.asarray(rows[i].output_token_ids, np.int32)) for i in pen]
            prompts = [(i, self._prompt_ids(rows[i].prompt_token_ids, cache)) for i in pen
                       if ps[i].repetition_penalty != 1]
            col = lambda name: mx.array([getattr(p, name) for p in ps], mx.float32)[:, None]  # noqa: E731
            x = _penalize(x, _counts(outs, R, V), _counts(prompts, R, V), col("repetition_penalty"),
                          col("frequency_penalty"), col("presence_penalty"))
        return x

    def _bias_arrays(self, p: SamplingParams, V: int, cache: dict) -> tuple[np.ndarray, np.ndarray]:
        """A request's logit_bias as (token ids, biases) arrays, in the vocabulary, built once per
        params object while its request keeps asking (per step, a vocabulary-wide bias was ~0.1 s
        of Python per row)."""
        hit = cache.get(id(p))
        if hit is None or hit[0] is not p:
            bias = p.logit_bias or {}
            t = np.fromiter(bias.keys(), np.int64, len(bias))
            b = np.fromiter(bias.values(), np.float32, len(bias))
            ok = (t >= 0) & (t < V)
            hit = (p, t[ok].astype(np.int32), b[ok])
        self._biases[id(p)] = hit
        return hit[1], hit[2]

    def _prompt_ids(self, seq: Sequence[int], cache: dict) -> np.ndarray:
        """Unique prompt ids, cached per prompt object while its request keeps asking for them."""
        hit = cache.get(id(seq))
        if hit is None or hit[0] is not seq or hit[1] != len(seq):
            hit = (seq, len(seq), np.unique(np.asarray(seq, np.int32)))
        self._prompts[id(seq)] = hit
        return hit[2]

    def _draw(self, x: mx.array, rows: Sequence[SamplingRow]) -> mx.array:
        R, V = x.shape
        ps = [r.params for r in rows]
        rand = [not p.greedy for p in ps]
        s = x / mx.array([p.temperature if r else 1.0 for p, r in zip(ps, rand)], mx.float32)[:, None]
        rnd = np.array(rand)
        col = lambda name, off: np.where(rnd, [getattr(p, name) for p in ps], off)  # noqa: E731
        min_p, top_k, top_p = col("min_p", 0.0), col("top_k", V), col("top_p", 1.0)
        top_k = np.where((top_k > 0) & (top_k < V), top_k, V)
        s = truncate(s, min_p if min_p.any() else None, top_k if (top_k < V).any() else None,
                     top_p if (top_p < 1).any() else None)
        keys = [self._key(r) if g else 0 for r, g in zip(rows, rand)]
        if self._lanes is None or self._lanes.shape[-1] != V:
            self._lanes = mx.arange(V, dtype=mx.uint32)[None]
        k1 = mx.array([k & _M32 for k in keys], mx.uint32)[:, None]
        k2 = mx.array([k >> 32 for k in keys], mx.uint32)[:, None]
        return _gumbel_argmax(s, self._lanes, k1, k2)

    def _key(self, row: SamplingRow) -> int:
        """64-bit noise key: a pure function of (seed, tokens generated) for seeded requests."""
        seed = row.params.seed
        if seed is None:
            return self._rng.getrandbits(64)
        return _splitmix64(_splitmix64(seed & _M64) ^ len(row.output_token_ids))


def _bad_words(words: Sequence[Sequence[int]], past: Sequence[int]) -> list[int]:
    """vLLM: ban a bad word's last token when the output so far ends with the rest of it."""
    banned = []
    m = len(past)
    for w in words:
        n = len(w) - 1
        # (the last token first: a word that cannot match costs no slice)
        if n == 0 or (n <= m and past[m - 1] == w[n - 1] and list(past[m - n :]) == list(w[:n])):
            banned.append(w[-1])
    return banned
