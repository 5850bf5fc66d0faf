"""The reference scheduler with speculative decoding, driving a real in-process worker: drafts are
scheduled (budget, blocks for the extra slots), rejected ones rolled back, and the output is the
same as without speculation, with chunked prefill, preemption and stops inside accepted drafts."""

from __future__ import annotations

import random

from sidecar.scheduler import Request, Scheduler, run
from tests.conftest import mlx_lm_greedy


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pat = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 9))]
        out.append(pat * rng.randrange(2, 5) + [rng.randrange(3, 500) for _ in range(rng.randrange(0, 6))])
    return out


def _generate(w, prompts, *, max_tokens=20, speculative: str = "none", num_blocks: int = 64, budget: int = 24,
              stop=()) -> tuple[dict[str, Request], Scheduler, list[dict]]:
    sched = Scheduler(num_blocks=num_blocks, block_size=w.config.block_size, max_num_batched_tokens=budget,
                      eos_token_ids=w.get_model()["eos_token_ids"], max_model_len=w.runner.max_model_len)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, {"temperature": 0.0}, max_tokens, stop_token_ids=stop))
    steps: list[dict] = []

    def execute(so: dict) -> dict:
        steps.append(so)
        return w.execute_model(so).to_wire()

    take = {"none": None, "worker": w.take_draft_token_ids,
            "scheduler": lambda: sched.propose_ngram(3, 1, 3)}[speculative]
    done = run(sched, execute, take_draft_token_ids=take)
    assert not w.runner.requests  # every request was dropped on the worker
    sched.blocks.check([])
    return done, sched, steps


def test_worker_drafts_through_the_scheduler_give_the_same_tokens(make_worker, oracle_model) -> None:
    w = make_worker(num_blocks=64, block_size=4, speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    ps = _prompts(5, seed=1)
    plain, _, _ = _generate(w, ps)
    # 24 blocks of 4 for five requests of up to ~65 tokens: preemption; budget 24: chunked prefill.
    spec, sched, steps = _generate(w, ps, speculative="worker", num_blocks=24)
    for rid, r in plain.items():
        assert spec[rid].output_token_ids == r.output_token_ids, rid
    assert plain["r0"].output_token_ids == mlx_lm_greedy(oracle_model("builtin:tiny"), ps[0], 20)[0]
    assert sum(r.num_preemptions for r in spec.values()) > 0
    assert any(len(so["num_scheduled_tokens"]) > 1 and so["scheduled_new_reqs"] for so in steps)
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert len(steps) < len(_generate(w, ps, num_blocks=24)[2])  # fewer steps for the same tokens
    # Every scheduled draft fits its request's count and block table.
    for so in steps:
        for rid, d in so["scheduled_spec_decode_tokens"].items():
            assert 1 <= len(d) <= 3 and so["num_scheduled_tokens"][rid] > len(d)


def test_scheduler_side_ngram_with_a_plain_worker(make_worker) -> None:
    w = make_worker(num_blocks=64)
    assert w.runner.proposer is None
    ps = _prompts(3, seed=2)
    plain, _, _ = _generate(w, ps, max_tokens=24)
    spec, sched, _ = _generate(w, ps, max_tokens=24, speculative="scheduler")
    assert {k: r.output_token_ids for k, r in spec.items()} == {k: r.output_token_ids for k, r in plain.items()}
    assert sched.num_accepted_tokens > 0


def test_a_stop_inside_accepted_drafts_drops_the_rest(make_worker) -> None:
    w = make_worker(num_blocks=64, speculative_method="ngram", prompt_lookup_min=1)
    p = [7, 8, 9] * 5
    plain, _, _ = _generate(w, [p], max_tokens=30)
    out = plain["r0"].output_token_ids
    stop = out[len(out) // 2]  # a token that comes up mid-way
    want, _, _ = _generate(w, [p], max_tokens=30, stop=(stop,))
    got, sched, _ = _generate(w, [p], max_tokens=30, stop=(stop,), speculative="worker")
    assert got["r0"].output_token_ids == want["r0"].output_token_ids
    assert got["r0"].finish_reason == want["r0"].finish_reason == "stop"
    # max_tokens: never more tokens than asked for, however many drafts are accepted.
    got, _, _ = _generate(w, [p], max_tokens=7, speculative="worker")
    assert got["r0"].output_token_ids == out[:7]


def test_drafts_are_trimmed_to_the_token_budget() -> None:
    sched = Scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=3)
    req = Request("a", [1, 2, 3], {}, 10)
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, {"req_id_to_index": {"a": 0}, "sampled_token_ids": [[5]]})
    sched.update_draft_token_ids({"req_ids": ["a", "ghost"], "draft_token_ids": [[6, 7, 8, 9], [1]]})
    so = sched.schedule()
    assert so["num_scheduled_tokens"] == {"a": 3} and so["scheduled_spec_decode_tokens"] == {"a": [6, 7]}
    # Two accepted + bonus: num_computed_tokens moves by 3; the scheduler owes the worker no rollback.
    sched.update_from_output(so, {"req_id_to_index": {"a": 0}, "sampled_token_ids": [[6, 7, 4]]})
    assert req.output_token_ids == [5, 6, 7, 4] and req.num_computed_tokens == req.num_tokens - 1
    sched.update_draft_token_ids({"req_ids": ["a"], "draft_token_ids": [[1, 1]]})
    so = sched.schedule()
    sched.update_from_output(so, {"req_id_to_index": {"a": 0}, "sampled_token_ids": [[2]]})  # both rejected
    assert req.output_token_ids[-1] == 2 and req.num_computed_tokens == req.num_tokens - 1 == 7
