"""Proposers in the worker (engine/proposers.py): n-gram prompt lookup and a draft model, their
drafts taken with take_draft_token_ids and verified in the next step."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from sidecar.errors import ProtocolError
from sidecar.models import resolve_model
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.spec_driver import SpecDriver


def _repeating(vocab: int, seed: int = 0, period: int = 7, times: int = 4) -> list[int]:
    rng = random.Random(seed)
    pat = [rng.randrange(3, vocab) for _ in range(period)]
    return pat * times


def _run(w, prompts: dict[str, list[int]], n: int, sampling: dict | None = None, preempt: str | None = None,
         chunk: int = 16) -> tuple[dict[str, list[int]], SpecDriver]:
    d = SpecDriver(w.execute_model, w.config.block_size, w.runner.num_blocks, take=w.take_draft_token_ids)
    for rid, p in prompts.items():
        d.add(rid, p, sampling)
    if preempt:
        for _ in range(6):
            d.step(chunk)
        d.preempt(preempt)
        d.step(chunk, only=[r for r in d.reqs if r != preempt])
    got = d.run(n, chunk)
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()
    assert not w.runner.requests and not w.runner.proposer.pending
    return got, d


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen3"])
def test_ngram_in_the_worker_matches_mlx_lm_greedy(make_worker, oracle_model, model: str) -> None:
    w = make_worker(model, speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                    prompt_lookup_max=3)
    V = w.vocab_size()
    ps = {"a": _repeating(V, 0), "b": _repeating(V, 1, period=3, times=6), "c": _repeating(V, 2, period=11, times=2)}
    before = (w.runner.spec.draft_tokens, w.runner.spec.accepted_tokens)
    got, d = _run(w, ps, 24, preempt="b", chunk=8)
    for rid, p in ps.items():
        assert got[rid] == mlx_lm_greedy(oracle_model(model), p, 24)[0], rid
    drafted, accepted = w.runner.spec.draft_tokens - before[0], w.runner.spec.accepted_tokens - before[1]
    assert 0 < accepted < drafted, (drafted, accepted)


def test_take_draft_token_ids_shape_and_taken_once(make_worker) -> None:
    w = make_worker(speculative_method="ngram", prompt_lookup_min=1)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7, 5, 6, 7, 5, 6], {"temperature": 0.0, "logit_bias": {7: 100.0}})  # samples 7
    d.step()
    got = w.take_draft_token_ids()
    assert got == {"req_ids": ["a"], "draft_token_ids": [[5, 6, 7]]}
    assert w.take_draft_token_ids() is None  # taken
    # Off by default: no proposer, nothing to take.
    plain = make_worker()
    assert plain.runner.proposer is None and plain.take_draft_token_ids() is None


def test_drafts_respect_max_tokens(make_worker) -> None:
    w = make_worker(speculative_method="ngram", prompt_lookup_min=1, num_speculative_tokens=5)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7] * 4, {"temperature": 0.0, "max_tokens": 3, "logit_bias": {5: 100.0}})
    d.step()
    got = w.take_draft_token_ids()
    assert got == {"req_ids": ["a"], "draft_token_ids": [[6]]}  # 1 output + 1 draft + the bonus = 3


def test_target_as_its_own_draft_gives_k_plus_one_tokens_per_step(make_worker, oracle_model) -> None:
    k = 3
    w = make_worker(draft_model="builtin:tiny", num_speculative_tokens=k)
    ps = {"a": [7, 8, 9, 10], "b": list(range(20, 45))}
    got, d = _run(w, ps, 17)
    for rid, p in ps.items():
        assert got[rid] == mlx_lm_greedy(oracle_model("builtin:tiny"), p, 17)[0]
    sizes = {n for step in d.tokens_per_step for n in step}
    assert sizes == {k + 1}, d.tokens_per_step


@pytest.fixture(autouse=True)
def _verify_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about what the proposers draft, not about when drafting pays: the verify
    cost the n-gram proposer measures at run time (spec_policy.measure, a timing) would make them
    depend on the machine's load, so it is pinned to free; tests/engine/test_spec_policy.py covers
    the policy with measured and given costs."""
    from sidecar.engine import proposers
    from sidecar.engine.spec_policy import VerifyCost

    monkeypatch.setattr(proposers, "_measure", lambda runner, k: VerifyCost(0.0))


@pytest.fixture(scope="module")
def noisy_draft(home: str) -> str:
    """builtin:tiny with a perturbed LM head: a draft that is right often, not always."""
    src = resolve_model("builtin:tiny", home)
    dst = Path(home) / "noisy-tiny-draft"
    if not dst.exists():
        shutil.copytree(src, dst)
        weights = mx.load(str(dst / "model.safetensors"))
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = head + 0.6 * mx.random.normal(head.shape, key=mx.random.key(3)) * head.std()
        mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return str(dst)


def test_a_different_draft_model_gives_mlx_lm_greedy_with_accepts_and_rejects(make_worker, oracle_model, noisy_draft) -> None:
    w = make_worker(draft_model=noisy_draft, num_speculative_tokens=3)
    rng = random.Random(5)
    ps = {f"r{i}": [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate([3, 19, 37])}
    before = (w.runner.spec.draft_tokens, w.runner.spec.accepted_tokens)
    got, _ = _run(w, ps, 20, preempt="r1", chunk=8)
    for rid, p in ps.items():
        assert got[rid] == mlx_lm_greedy(oracle_model("builtin:tiny"), p, 20)[0], rid
    drafted, accepted = w.runner.spec.draft_tokens - before[0], w.runner.spec.accepted_tokens - before[1]
    assert 0 < accepted < drafted, (drafted, accepted)
    assert w.runner.proposer.free_blocks and not w.runner.proposer.seqs  # draft blocks returned


def test_sampled_with_a_draft_model_is_reproducible(make_worker, noisy_draft) -> None:
    w = make_worker(draft_model=noisy_draft, num_speculative_tokens=2)
    p = {"s": [11, 12, 13, 14, 15]}
    params = {"temperature": 0.9, "seed": 7}
    a, _ = _run(w, p, 12, params)
    b, _ = _run(w, p, 12, params)
    c, _ = _run(w, p, 12, {**params, "seed": 8})
    assert a == b and a != c


def test_draft_model_with_another_vocabulary_is_refused(make_worker, home: str) -> None:
    src = resolve_model("builtin:tiny", home)
    dst = Path(home) / "tiny-other-vocab"
    if not dst.exists():
        shutil.copytree(src, dst)
        weights = mx.load(str(dst / "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = weights[name][:300]
        mx.save_safetensors(str(dst / "model.safetensors"), weights)
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ProtocolError) as e:
        make_worker(draft_model=str(dst))
    assert e.value.field == "config.draft_model" and "vocabulary (300)" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        make_worker(draft_model=str(Path(home) / "no-such-model"))
    assert e.value.field == "config.draft_model"


def test_available_memory_leaves_room_for_the_draft(make_worker) -> None:
    small = {"num_blocks": 8, "max_num_batched_tokens": 64, "max_num_seqs": 4}  # a quick profile run
    plain = make_worker(**small).determine_available_memory()
    with_draft = make_worker(**small, draft_model="builtin:tiny").determine_available_memory()
    assert with_draft < 0.6 * plain  # a draft as large as the target: about half the KV bytes each


def test_draft_length_adapts_to_rejections_and_pauses() -> None:
    from sidecar.engine.proposers import _Pace

    p = _Pace(3)
    # (drafted, accepted) of the step just verified -> drafts allowed for the next one
    steps = [((0, 0), 3), ((3, 3), 3), ((3, 1), 2), ((2, 0), 1), ((1, 0), 0), ((0, 0), 1),
             ((1, 0), 0), ((0, 0), 0), ((0, 0), 1), ((1, 1), 3)]
    assert [p.update(3, d, a) for (d, a), _ in steps] == [want for _, want in steps]


def test_propose_drafts_only_where_lookup_matches_and_not_while_paused() -> None:
    """A row whose text lookup can match gets drafts; one with nothing to match, or paused after
    rejections, gets none."""
    from sidecar.engine.proposers import NgramProposer
    from sidecar.engine.state import RequestState, Row
    from sidecar.engine.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0)

    def row(rid: str, prompt: list[int], out: list[int]) -> Row:
        s = RequestState(rid, prompt, greedy, [0], output_token_ids=out)
        return Row(s, s.num_tokens - 1, [out[-1]], [0], True)

    p = NgramProposer(3, 2, 4)
    fresh = row("a", [10, 11, 12, 13], [14])  # no token repeats: no 2-gram can match
    again = row("b", [10, 11, 12, 13], [11])  # 11 occurred before, followed by 12

    class _R:
        max_model_len = 1 << 20
    assert p.propose(_R(), [fresh], [[15]]) == set() and p.propose(_R(), [again], [[12]]) == {"b"}
    p.paces["b"].wait = 2  # paused after rejections: no drafts until the pause ends
    assert p.propose(_R(), [again], [[12]]) == set()


def test_drafting_pauses_where_drafts_fail_through_a_real_server(home: str, oracle_model) -> None:
    """Through a real server (take_draft_token_ids over HTTP), two greedy requests batched: one
    whose text the model does not copy, where drafts keep failing and the proposer pauses (fewer
    drafted steps than steps lookup could draft for), and one the model copies exactly, never
    paused (the control). Both are mlx-lm's greedy tokens; the metrics show accepted drafts."""
    from sidecar.client.remote import RemoteWorker
    from sidecar.engine.ngram import ngram_drafts
    from tests.server.serverproc import start_server
    from tests.server.prom import samples, scrape

    import numpy as np

    def pattern(seed: int, vocab: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(3, vocab) for _ in range(7)] * 4

    # (verification given as free: whether drafting pays is not this test's question, and the
    # server's own measurement is a timing that a loaded machine skews)
    with start_server("--speculative-method", "ngram", "--num-speculative-tokens", "2", "--prompt-lookup-min", "1",
                      "--prompt-lookup-max", "4", "--speculative-verify-cost", "0",
                      "--max-num-batched-tokens", "64", "--max-num-seqs", "4") as s:
        w = RemoteWorker(s.url)
        try:
            w.init_device()
            w.load_model()
            w.initialize_cache(num_gpu_blocks=128)
            V = int(w.info()["vocab_size"])
            prompts = {"fails": pattern(0, V), "copies": pattern(3, V)}
            seen = {rid: [0, 0] for rid in prompts}  # steps lookup could draft for, steps drafted for

            def take() -> dict | None:
                got = w.take_draft_token_ids()
                drafted = set(got["req_ids"]) if got else set()
                for rid, r in d.reqs.items():
                    if r.out and r.rid in seen and len(r.out) < 40 - 1:
                        seen[rid][0] += bool(ngram_drafts(np.asarray(r.prompt + r.out, np.int32), 1, 4, 2))
                        seen[rid][1] += rid in drafted
                return got

            d = SpecDriver(lambda so: w.call("execute_model", scheduler_output=so), w.info()["block_size"], 128, take=take)
            for rid, p in prompts.items():
                d.add(rid, p)
            got = d.run(40, 16)
            oracle = oracle_model("builtin:tiny")
            for rid, p in prompts.items():
                assert got[rid] == mlx_lm_greedy(oracle, p, 40)[0], rid
            m = samples(scrape(s.url))
        finally:
            w.close()
    assert m[("mlx_worker_spec_decode_accepted_tokens_total", ())] > 0
    lookups, drafted = seen["fails"]
    assert 0 < drafted < lookups - 4, seen  # paused on several steps lookup could have drafted for
    assert 0 < seen["copies"][1] == seen["copies"][0], seen  # every lookup drafted, never paused
