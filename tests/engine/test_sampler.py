"""Sampler: vLLM v1 semantics checked against direct numpy computations of vLLM's formulas."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from sidecar.engine import sampler as S
from sidecar.engine.sampler import Sampler, SamplingParams, SamplingRow, prompt_logprobs, truncate

EOS = 2


def rows_of(params, prompt=(), output=()):
    return [SamplingRow(p, list(prompt), output) for p in params]


def draw(logits: np.ndarray, params: list[SamplingParams], outputs=None, seed=0) -> np.ndarray:
    rows = [SamplingRow(p, [], outputs[i] if outputs else []) for i, p in enumerate(params)]
    return np.array(Sampler(logits.shape[-1], [EOS], seed).sample(mx.array(logits), rows).token_ids)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def chi2_crit(df: int, z: float = 3.0902) -> float:
    """Upper 0.1% point of chi-square(df) (Wilson-Hilferty; z = normal 0.999 quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * len(tokens)
    observed = np.bincount(tokens, minlength=len(probs))
    assert observed[expected == 0].sum() == 0, "drew a token of probability 0"
    nz = expected > 0
    return float(((observed[nz] - expected[nz]) ** 2 / expected[nz]).sum())


def vllm_kept(s: np.ndarray, min_p=0.0, top_k=0, top_p=1.0) -> np.ndarray:
    """vLLM's min_p, then top-k / top-p by sorted position, on one row of scaled logits."""
    s = s.astype(np.float32).copy()
    if min_p > 0:
        p = softmax(s)
        s[p < min_p * p.max()] = -np.inf
    order = np.argsort(s, kind="stable")  # ascending
    srt = s[order]
    if top_k > 0:
        srt[srt < srt[len(s) - top_k]] = -np.inf
    if top_p < 1:
        cum = np.cumsum(softmax(srt))
        mask = cum <= 1 - np.float32(top_p)
        mask[-1] = False
        srt[mask] = -np.inf
    out = np.empty_like(s)
    out[order] = srt
    return np.isfinite(out)


# ------------------------------------------------------------------ distributions and truncation


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = np.random.default_rng(1).normal(size=(48, 500)).astype(np.float32) * 2
    argmax = logits.argmax(-1)
    assert (draw(logits, [SamplingParams(temperature=0.0)] * 48) == argmax).all()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        params = [SamplingParams(temperature=1.5, seed=i, **kw) for i in range(48)]
        assert (draw(logits, params) == argmax).all(), kw
    # control: plain sampling at this temperature does leave the argmax
    assert (draw(logits, [SamplingParams(temperature=1.5, seed=i) for i in range(48)]) != argmax).any()


@pytest.mark.parametrize("how", ["seeds", "steps", "unseeded"])
def test_temperature_draws_follow_softmax(how):
    V, N, T = 10, 6000, 0.7
    logits = np.random.default_rng(2).permutation(np.linspace(0, 3, V)).astype(np.float32)
    if how == "seeds":  # one step of many seeded requests
        params, outputs = [SamplingParams(temperature=T, seed=1000 + i) for i in range(N)], None
    elif how == "steps":  # one seeded request at many output lengths
        params, outputs = [SamplingParams(temperature=T, seed=7)] * N, [range(n) for n in range(N)]
    else:
        params, outputs = [SamplingParams(temperature=T)] * N, None
    toks = draw(np.tile(logits, (N, 1)), params, outputs)
    assert chi2(toks, softmax(logits / T)) < chi2_crit(V - 1)
    # negative control: the same statistic against the wrong temperature fails
    assert chi2(toks, softmax(logits / 1.0)) > chi2_crit(V - 1)
    assert chi2(toks, softmax(logits / 0.55)) > chi2_crit(V - 1)


def test_truncated_draws_follow_renormalised_softmax():
    V, N, T = 12, 6000, 1.3
    logits = np.random.default_rng(3).normal(size=V).astype(np.float32)
    toks = draw(np.tile(logits, (N, 1)), [SamplingParams(temperature=T, top_k=4, seed=i) for i in range(N)])
    s = logits / T
    kept = vllm_kept(s, top_k=4)
    p = np.where(kept, softmax(np.where(kept, s, -np.inf)), 0)
    assert chi2(toks, p) < chi2_crit(3)
    # control: the untruncated softmax is rejected (it puts mass on dropped tokens)
    with pytest.raises(AssertionError, match="probability 0"):
        chi2(np.concatenate([toks, np.flatnonzero(~kept)]), p)
    assert chi2(toks, softmax(np.where(kept, logits, -np.inf))) > chi2_crit(3)


CONFIGS = [
    dict(temperature=1.5, min_p=0.1),
    dict(temperature=1.0, top_k=5),
    dict(temperature=2.0, top_p=0.5),
    dict(temperature=1.3, min_p=0.02, top_k=12, top_p=0.8),
    dict(temperature=0.8, top_k=40, top_p=0.9),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_stay_in_the_kept_set_and_cover_it(cfg):
    V, N = 60, 3000
    logits = np.random.default_rng(4).normal(size=V).astype(np.float32) * 2
    s = logits / cfg["temperature"]
    kept = vllm_kept(s, cfg.get("min_p", 0.0), cfg.get("top_k", 0), cfg.get("top_p", 1.0))
    assert 1 < kept.sum() < V - 5  # the configuration really truncates
    p = softmax(np.where(kept, s, -np.inf))
    assert (p[kept] * N).min() > 15  # every kept token is expected often enough to be seen
    toks = draw(np.tile(logits, (N, 1)), [SamplingParams(seed=i, **cfg) for i in range(N)])
    assert set(toks.tolist()) == set(np.flatnonzero(kept).tolist())


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_truncate_thresholds_match_vllm(backend, monkeypatch):
    R, V = 24, 400
    rng = np.random.default_rng(5)
    s = (rng.normal(size=(R, V)) * rng.uniform(0.3, 4, size=(R, 1))).astype(np.float32)
    s[3, :200] = -np.inf  # e.g. allowed_token_ids
    min_p = np.where(np.arange(R) % 3 == 0, rng.uniform(0, 0.3, R), 0).astype(np.float32)
    top_k = np.where(np.arange(R) % 2 == 0, rng.integers(1, 80, R), V)
    top_p = np.where(np.arange(R) % 4 != 1, rng.uniform(0.05, 1, R), 1).astype(np.float32)
    # truncate() sorts with numpy on the CPU backend and with MLX elsewhere: check both paths here
    monkeypatch.setattr(S.mx, "default_device", lambda: mx.cpu if backend == "numpy" else mx.gpu)
    got = np.isfinite(np.array(truncate(mx.array(s), min_p, top_k, top_p)))
    for r in range(R):
        want = vllm_kept(s[r], min_p[r], top_k[r] if top_k[r] < V else 0, top_p[r])
        assert (got[r] == want).all(), r
    assert (got.sum(-1) < np.isfinite(s).sum(-1)).sum() >= R // 2  # most rows did truncate


# ------------------------------------------------------------------ processed logits


def ref_process(x, p: SamplingParams, prompt, out, eos=(EOS,)):
    """vLLM v1 order, written out per row with numpy."""
    x = x.astype(np.float32).copy()
    V = len(x)
    if p.allowed_token_ids:
        keep = np.zeros(V, bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for w in p.bad_words_token_ids or ():
        if len(w) <= len(out) + 1 and list(out[len(out) - (len(w) - 1):] if len(w) > 1 else []) == list(w[:-1]):
            x[w[-1]] = -np.inf
    if len(out) < p.min_tokens:
        x[list(p.stop_token_ids or ()) + list(eos)] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(out, int), minlength=V)[:V]
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, int), minlength=V)[:V] > 0)
    rep = np.where(seen, p.repetition_penalty, 1.0).astype(np.float32)
    x = np.where(x > 0, x / rep, x * rep)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_processed_logits_match_vllm_formulas():
    V = 64
    rng = np.random.default_rng(6)
    cases = [
        (SamplingParams(), [1, 2], [3]),
        (SamplingParams(repetition_penalty=1.7), [5, 6, 6, 9], [9, 10, 10]),
        (SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5, presence_penalty=-0.3), [1, 4], [4, 4, 4, 7, 8]),
        (SamplingParams(frequency_penalty=-1.2, presence_penalty=1.5), [11, 12], [12, 13, 13]),
        (SamplingParams(logit_bias={0: 5.0, 63: -3.5, 7: 0.25}), [1], []),
        (SamplingParams(min_tokens=3, stop_token_ids=(17, 18)), [1], [5, 6]),  # still masked
        (SamplingParams(min_tokens=2, stop_token_ids=(17, 18)), [1], [5, 6]),  # reached: not masked
        (SamplingParams(allowed_token_ids=(3, 9, 40, 41)), [1], [2]),
        (SamplingParams(bad_words_token_ids=((20,), (30, 31), (32, 33), (6, 30, 34), (5, 30, 35))), [1], [8, 5, 6, 30]),
        (SamplingParams(bad_words_token_ids=((1, 2, 3, 4, 35), (3, 36))), [1], [2, 3]),  # 1st longer than output + 1
        (SamplingParams(allowed_token_ids=(3, 9, 20, 21), bad_words_token_ids=((9,),), logit_bias={21: 2.0, 22: 1.0},
                        repetition_penalty=1.3, presence_penalty=0.7, min_tokens=1, stop_token_ids=(20,)), [3, 21], []),
    ]
    logits = (rng.normal(size=(len(cases), V)) * 3).astype(np.float32)
    rows = [SamplingRow(p, prompt, out) for p, prompt, out in cases]
    got = np.array(Sampler(V, [EOS]).process_logits(mx.array(logits), rows))
    for i, (p, prompt, out) in enumerate(cases):
        want = ref_process(logits[i], p, prompt, out)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=str(i))
        if i not in (0, 6):  # the others change something (so a no-op implementation fails)
            assert not np.array_equal(got[i], logits[i]), i
    assert np.isneginf(got[5][[17, 18, EOS]]).all() and np.isfinite(got[6][[17, 18, EOS]]).all()
    assert np.isneginf(got[8][[20, 31, 34]]).all() and np.isfinite(got[8][[33, 35]]).all()
    assert np.isneginf(got[9][36]) and np.isfinite(got[9][35])
    assert np.isfinite(got[10]).sum() == 2  # 3 (penalised), 21 (biased, penalised)


def test_penalties_steer_greedy_tokens():
    logits = np.zeros((2, 8), np.float32)
    logits[:, 3] = 1.0
    logits[:, 4] = 0.9
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    res = Sampler(8, [EOS]).sample(mx.array(logits), [SamplingRow(p, [], [3]), SamplingRow(p, [], [])])
    assert res.token_ids == [4, 3]


def test_repetition_penalty_follows_each_steps_prompt():
    """Prompt ids are cached per prompt object: a new or grown prompt must not reuse stale ids."""
    V = 16
    logits = mx.array(np.full((1, V), 2.0, np.float32))
    sampler = Sampler(V, [EOS])
    p = SamplingParams(repetition_penalty=2.0)

    def penalised(prompt):
        return np.flatnonzero(np.array(sampler.process_logits(logits, [SamplingRow(p, prompt, [])]))[0] == 1.0).tolist()

    prompt = [1, 2]
    assert penalised(prompt) == [1, 2]
    assert penalised(prompt) == [1, 2]  # cached
    assert penalised([3, 4]) == [3, 4]
    prompt.append(5)
    assert penalised(prompt) == [1, 2, 5]
    assert Sampler(V, [EOS]).sample(mx.zeros((0, V)), []).token_ids == []


# ------------------------------------------------------------------ seeds


def run_steps(sampler, seeded: SamplingParams, steps, history, batch: int = 1, at: int = 0):
    """Sample `steps` tokens for the seeded row; other rows (if any) get their own params."""
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=3, seed=9),
              SamplingParams(temperature=1.2, top_p=0.7, repetition_penalty=1.2), SamplingParams(min_p=0.2, seed=3),
              SamplingParams(temperature=0.9, logprobs=2, frequency_penalty=0.4)]
    out = list(history)
    for step in steps:
        logits = np.random.default_rng([11, step, batch]).normal(size=(batch, 200)).astype(np.float32)
        logits[at] = np.random.default_rng([11, step]).normal(size=200)
        rows = [SamplingRow(others[i % len(others)], [1, 2], [i] * step) for i in range(batch)]
        rows[at] = SamplingRow(seeded, [5, 6, 7], list(out))
        out.append(sampler.sample(mx.array(logits), rows).token_ids[at])
    return out[len(history):]


def test_seed_reproducible_alone_batched_and_after_preemption():
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=100, seed=1234, presence_penalty=0.3)
    alone = run_steps(Sampler(200, [EOS], seed=0), p, range(8), [])
    batched = run_steps(Sampler(200, [EOS], seed=1), p, range(8), [], batch=16, at=5)
    assert batched == alone
    # preempted after 4 tokens, resumed elsewhere (other sampler state, other batch) from the same history
    resumed = run_steps(Sampler(200, [EOS], seed=2), p, range(4, 8), alone[:4], batch=9, at=8)
    assert resumed == alone[4:]
    # negative control: another seed draws other tokens
    other = run_steps(Sampler(200, [EOS], seed=0), SamplingParams(**{**p.__dict__, "seed": 1235}), range(8), [])
    assert other != alone


def test_unseeded_rows_follow_the_sampler_seed():
    logits = np.random.default_rng(12).normal(size=(32, 100)).astype(np.float32)
    params = [SamplingParams(temperature=1.0)] * 32
    assert (draw(logits, params, seed=5) == draw(logits, params, seed=5)).all()
    assert (draw(logits, params, seed=5) != draw(logits, params, seed=6)).any()


# ------------------------------------------------------------------ logprobs, NaNs


def test_logprobs_are_raw_with_sampled_first_and_vllm_ranks():
    V = 300
    rng = np.random.default_rng(13)
    logits = (rng.normal(size=(6, V)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0, logprobs=5, logit_bias={7: 100.0}),  # sampled = 7, not raw argmax
              SamplingParams(temperature=1.0, seed=3, logprobs=0),
              SamplingParams(temperature=0.8, seed=4),  # did not ask: still gets a row
              SamplingParams(temperature=1.0, top_k=20, seed=5, logprobs=1, repetition_penalty=1.5),
              SamplingParams(temperature=0)]
    res = Sampler(V, [EOS]).sample(mx.array(logits), rows_of(params, prompt=[7, 8]))
    ref = log_softmax(logits)
    assert res.token_ids[1] == 7 and res.token_ids[0] == logits[0].argmax()
    assert len(res.logprob_token_ids) == 6 and all(len(r) == 6 for r in res.logprob_token_ids)  # max k + 1
    for i in range(6):
        ids, lps, tok = res.logprob_token_ids[i], res.logprobs[i], res.token_ids[i]
        assert ids[0] == tok
        np.testing.assert_allclose(lps, ref[i][ids], atol=1e-5)
        np.testing.assert_allclose(lps[1:], np.sort(ref[i])[::-1][:5], atol=1e-5)
        assert res.sampled_token_ranks[i] == (ref[i] >= ref[i][tok]).sum()
    assert res.sampled_token_ranks[0] == 1 and res.sampled_token_ranks[1] > 1


def test_logprobs_whole_vocabulary_and_none():
    V = 50
    logits = np.random.default_rng(14).normal(size=(2, V)).astype(np.float32)
    res = Sampler(V, [EOS]).sample(mx.array(logits), rows_of([SamplingParams(logprobs=-1), SamplingParams()]))
    ref = log_softmax(logits)
    assert all(len(r) == V + 1 for r in res.logprob_token_ids)
    for i in range(2):
        assert sorted(res.logprob_token_ids[i][1:]) == list(range(V))
        np.testing.assert_allclose(res.logprobs[i][1:], np.sort(ref[i])[::-1], atol=1e-5)
    none = Sampler(V, [EOS]).sample(mx.array(logits), rows_of([SamplingParams(prompt_logprobs=3)] * 2))
    assert none.logprob_token_ids is none.logprobs is none.sampled_token_ranks is None


@pytest.mark.parametrize("k", [0, 2, -1])
def test_prompt_logprobs(k):
    V = 40
    logits = (np.random.default_rng(15).normal(size=(7, V)) * 2).astype(np.float32)
    targets = [3, 0, 39, 17, 17, 5, 2]
    ids, lps, ranks = prompt_logprobs(mx.array(logits), targets, k)
    ref = log_softmax(logits)
    width = V if k == -1 else k
    for i, t in enumerate(targets):
        assert len(ids[i]) == width + 1 and ids[i][0] == t
        np.testing.assert_allclose(lps[i], ref[i][ids[i]], atol=1e-5)
        np.testing.assert_allclose(lps[i][1:], np.sort(ref[i])[::-1][:width], atol=1e-5)
        assert ranks[i] == (ref[i] >= ref[i][t]).sum()


def test_nans_are_counted_and_bf16_logits_work():
    logits = np.random.default_rng(16).normal(size=(3, 30)).astype(np.float32)
    logits[0, [1, 5, 9]] = np.nan
    logits[2, 0] = np.nan
    res = Sampler(30, [EOS]).sample(mx.array(logits), rows_of([SamplingParams(temperature=0)] * 3))
    assert res.num_nans == [3, 0, 1]
    assert res.token_ids[1] == logits[1].argmax()
    bf = mx.array(logits[1:2]).astype(mx.bfloat16)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2)]
    res = Sampler(30, [EOS]).sample(bf, rows_of(params))
    assert res.num_nans == [0] and len(res.logprobs[0]) == 3


def test_greedy_ranks_half_precision_logits_as_mlx_lm_does():
    """bf16 logits one ulp apart that round to one logprob: mlx-lm's greedy (argmax of logits -
    logsumexp, in bf16) takes the first, the argmax of the logits the larger."""
    base = np.linspace(-0.5, 0.25, 4096, dtype=np.float32)  # logsumexp ~8: logprobs' ulp 1/32
    base[10], base[40] = 0.5, 0.50390625  # adjacent bf16 values at 0.5 (ulp 1/256)
    x = mx.array(base[None]).astype(mx.bfloat16)
    mlx_lm = int(mx.argmax(x - mx.logsumexp(x, keepdims=True), axis=-1).item())
    assert int(mx.argmax(x, axis=-1).item()) == 40 and mlx_lm == 10  # a real near-tie (the control)
    assert S.greedy_tokens(x).tolist() == [10]
    res = Sampler(4096, []).sample(x, [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], [])])
    assert res.token_ids == [10]  # the full sampler's greedy too
    f32 = mx.array(base[None])
    assert S.greedy_tokens(f32).tolist() == [40]  # float32 keeps them apart


def test_logit_bias_arrays_are_built_once_per_request() -> None:
    """A vocabulary-wide logit_bias costs its Python loop once, not every step: the arrays are
    kept per params object while its request is in the batch (and dropped once it is not)."""
    V = 64
    p = SamplingParams(logit_bias={t: 0.25 * (t % 3) for t in range(V)})
    q = SamplingParams(logit_bias={5: -1.0})
    s = Sampler(V, [EOS])
    x = mx.zeros((2, V))
    first = np.array(s.process_logits(x, [SamplingRow(p, [1], [2]), SamplingRow(q, [1], [])]))
    arrays = s._biases[id(p)][1]
    again = np.array(s.process_logits(x, [SamplingRow(p, [1], [2, 3]), SamplingRow(q, [1], [4])]))
    assert s._biases[id(p)][1] is arrays  # not rebuilt
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first[0], [0.25 * (t % 3) for t in range(V)])
    assert first[1, 5] == -1.0 and (np.delete(first[1], 5) == 0).all()
    s.process_logits(x[:1], [SamplingRow(q, [1], [])])
    assert id(p) not in s._biases  # p's request left the batch
