"""The reference scheduler against a fake worker (tests/scheduler/fake_worker.py) that checks every
step it is sent: tokens equal solo runs through prefix hits, chunking, preemption, stops and aborts."""

from __future__ import annotations

import copy
import random

import pytest

from sidecar.scheduler import Request, Scheduler, Status, run
from tests.scheduler.fake_worker import (VOCAB, WireError, check_preemption_order, drive, hits, make_scheduler,
                                         random_workload, reference, solo)


def test_random_workloads_match_solo_runs_without_leaks():
    totals = {"preempted": 0, "resumed_hits": 0, "new_hits": 0, "chunks": 0}
    for seed in range(60):  # the totals below check that these seeds reach every path
        reqs, kw = random_workload(seed)
        expected = {r.req_id: solo(r, eos=(0,)) for _, r in reqs}
        sched, worker = make_scheduler(**kw)
        done = drive(sched, worker, reqs)
        for _, r in reqs:
            got = done[r.req_id]
            assert (got.output_token_ids, got.finish_reason) == expected[r.req_id], (seed, r.req_id)
            assert expected[r.req_id] == reference(r.prompt_token_ids, r.max_tokens, eos=(0,), stop=r.stop_token_ids,
                                                   ignore_eos=r.ignore_eos, min_tokens=r.min_tokens)
            assert done[r.req_id].status is Status.FINISHED
        totals["preempted"] += check_preemption_order(worker)
        totals["chunks"] += worker.chunks
        for rid, hs in hits(worker).items():
            assert kw["enable_prefix_caching"] or not any(hs), (seed, rid, hs)
            totals["new_hits"] += hs[0] > 0
            totals["resumed_hits"] += sum(h > 0 for h in hs[1:])
    # The workloads must actually exercise what they claim to test.
    assert all(v > 0 for v in totals.values()), totals


def shared_prompts(n: int, prefix_len: int = 18, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(3 + i)] for i in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_hits_shared_prompts(caching):
    prompts = shared_prompts(4)
    sched, worker = make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=caching)
    # r0 first; r1 once r0's prefill is computed (its blocks are cached while it runs);
    # r2 and r3 after r0 and r1 have finished (their blocks are free but still cached).
    arrivals = [(0, Request("r0", prompts[0], {}, 5)), (1, Request("r1", prompts[1], {}, 5)),
                (20, Request("r2", prompts[2], {}, 5)), (20, Request("r3", prompts[0], {}, 5))]
    done = drive(sched, worker, arrivals)
    got = {rid: hs[0] for rid, hs in hits(worker).items()}
    if caching:
        # 18 shared tokens = 4 full blocks of 4; r3 repeats r0's prompt of 21 tokens: 5 full blocks.
        assert got == {"r0": 0, "r1": 16, "r2": 16, "r3": 20}
        assert done["r3"].num_cached_tokens == 20
    else:
        assert got == {"r0": 0, "r1": 0, "r2": 0, "r3": 0}
    for rid, req in done.items():
        assert (req.output_token_ids, req.finish_reason) == reference(req.prompt_token_ids, 5)


@pytest.mark.parametrize("length, hit", [(8, 4), (9, 8), (4, 0), (5, 4)])
def test_prefix_hit_leaves_at_least_one_token_to_compute(length, hit):
    prompt = list(range(1, length + 1))
    sched, worker = make_scheduler(num_blocks=16, block_size=4)
    drive(sched, worker, [(0, Request("a", prompt, {}, 2)), (10, Request("b", prompt, {}, 2))])
    assert hits(worker)["b"] == [hit]
    (so,) = [so for so in worker.steps if [nr["req_id"] for nr in so["scheduled_new_reqs"]] == ["b"]]
    assert so["num_scheduled_tokens"]["b"] == length - hit


def test_preemption_by_recompute_gives_identical_tokens():
    prompts = shared_prompts(3, prefix_len=6, seed=3)
    reqs = [(0, Request(f"r{i}", p, {}, 12)) for i, p in enumerate(prompts)]
    # Each fits alone (ceil((6+5+12-1)/2) = 11 blocks) but not all three together.
    sched, worker = make_scheduler(num_blocks=12, block_size=2, max_num_batched_tokens=64)
    done = drive(sched, worker, reqs)
    preempted = [rid for so in worker.steps for rid in so["preempted_req_ids"]]
    assert preempted, "the budget must force preemption"
    for rid in set(preempted):
        assert done[rid].num_preemptions > 0
        # It comes back as a cached request flagged resumed, carrying its whole new block table.
        resumed = [(so, i) for so in worker.steps for i, r in enumerate(so["scheduled_cached_reqs"]["req_ids"])
                   if r == rid and rid in so["scheduled_cached_reqs"]["resumed_req_ids"]]
        assert resumed
        for so, i in resumed:
            c = so["scheduled_cached_reqs"]
            table = c["new_block_ids"][i][0]
            assert len(table) * 2 >= c["num_computed_tokens"][i] + so["num_scheduled_tokens"][rid]
        assert sum(rid in [nr["req_id"] for nr in so["scheduled_new_reqs"]] for so in worker.steps) == 1
    assert check_preemption_order(worker) == len(preempted)
    for _, r in reqs:
        assert (done[r.req_id].output_token_ids, done[r.req_id].finish_reason) == reference(r.prompt_token_ids, 12)


def test_chunked_prefill_respects_budgets():
    prompts = shared_prompts(5, prefix_len=30, seed=5)
    sched, worker = make_scheduler(num_blocks=200, block_size=4, max_num_batched_tokens=7, max_num_seqs=3,
                                   long_prefill_token_threshold=5, enable_prefix_caching=False)
    done = drive(sched, worker, [(0, Request(f"r{i}", p, {}, 4)) for i, p in enumerate(prompts)])
    assert max(so["total_num_scheduled_tokens"] for so in worker.steps) == 7
    assert max(n for so in worker.steps for n in so["num_scheduled_tokens"].values()) == 5
    assert max(len(so["num_scheduled_tokens"]) for so in worker.steps) == 3
    assert worker.chunks > 0
    for rid, req in done.items():
        assert req.output_token_ids == reference(req.prompt_token_ids, 4)[0]


def find_prompt(pred) -> tuple[list[int], list[int]]:
    """A prompt whose reference output (30 tokens, no stops) satisfies pred."""
    rng = random.Random(7)
    while True:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
        out, _ = reference(prompt, 30)
        if pred(out):
            return prompt, out


def generate(req: Request, eos=(), **kw) -> Request:
    sched, worker = make_scheduler(num_blocks=64, block_size=4, eos_token_ids=eos, **kw)
    return drive(sched, worker, [(0, req)])[req.req_id]


def test_stop_on_eos_stop_ids_and_max_tokens():
    prompt, out = find_prompt(lambda o: o[5] not in o[:5] and o[3] not in o[:3] and o[3] != o[5]
                              and o[5] in o[6:20])
    eos, stop = out[5], out[3]

    r = generate(Request("eos", prompt, {}, 30), eos=(eos,))
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (out[:6], "stop", eos)

    r = generate(Request("ignore", prompt, {}, 30, ignore_eos=True), eos=(eos,))
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (out, "length", None)

    r = generate(Request("stop", prompt, {}, 30, stop_token_ids=(stop,), ignore_eos=True), eos=(eos,))
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (out[:4], "stop", stop)

    r = generate(Request("min", prompt, {"min_tokens": 7}, 30), eos=(eos,))
    again = out.index(eos, 6) + 1
    assert (r.output_token_ids, r.finish_reason) == (out[:again], "stop")

    for n in (1, 2, 17):
        r = generate(Request("len", prompt, {}, n))
        assert (r.output_token_ids, r.finish_reason) == (out[:n], "length")


def test_wire_sampling_params_carry_vllm_stop_fields():
    sched, worker = make_scheduler(num_blocks=16, block_size=4)
    drive(sched, worker, [(0, Request("a", [1, 2, 3], {"temperature": 0.5, "seed": 7}, 3, (4, 5), True))])
    (nr,) = worker.steps[0]["scheduled_new_reqs"]
    assert nr["sampling_params"] == {"temperature": 0.5, "seed": 7, "max_tokens": 3, "stop_token_ids": [4, 5],
                                     "ignore_eos": True}


def test_abort_running_waiting_and_preempted():
    prompts = shared_prompts(4, prefix_len=6, seed=11)
    reqs = [Request(f"r{i}", p, {}, 12) for i, p in enumerate(prompts)]
    sched, worker = make_scheduler(num_blocks=12, block_size=2, max_num_seqs=3)
    aborted_at: dict[str, int] = {}  # req id -> index of the first step after its abort

    def abort(req: Request) -> None:
        assert not req.is_finished
        sched.abort(req.req_id)
        aborted_at[req.req_id] = len(worker.steps)

    def hook() -> None:
        if "r3" not in aborted_at:
            assert reqs[3].status is Status.WAITING
            abort(reqs[3])  # waiting, never sent to the worker
        preempted = [r for r in reqs if r.status is Status.PREEMPTED]
        if preempted and len(aborted_at) == 1:
            abort(preempted[0])
        if len(reqs[0].output_token_ids) == 5 and "r0" not in aborted_at:
            assert reqs[0].status is Status.RUNNING
            abort(reqs[0])

    drive(sched, worker, [(0, r) for r in reqs], hook)
    assert len(aborted_at) == 3, "a request must have been preempted"
    assert reqs[0].finish_reason == "abort" and reqs[0].output_token_ids == reference(prompts[0], 12)[0][:5]
    assert reqs[3].finish_reason == "abort" and reqs[3].output_token_ids == []
    for rid, step in aborted_at.items():
        if rid != "r3":  # reported to the worker in the next step, never scheduled again
            assert rid in worker.steps[step]["finished_req_ids"]
        assert all(rid not in so["num_scheduled_tokens"] for so in worker.steps[step:])
    assert all("r3" not in so["finished_req_ids"] for so in worker.steps)
    for r in reqs:
        assert r.status is Status.FINISHED
        if r.finish_reason != "abort":
            assert r.output_token_ids == reference(r.prompt_token_ids, 12)[0]
    sched.abort("r0")  # already gone: a no-op
    sched.abort("nope")


def test_run_ends_with_a_finished_only_step():
    sched, worker = make_scheduler(num_blocks=16, block_size=4)
    sched.add_request(Request("a", [1, 2, 3], {}, 2))
    sched.add_request(Request("b", [1, 2], {}, 3))
    events = []
    done = run(sched, worker, events.append)
    # a finishes first: the next step drops it while b still runs; a last step only drops b.
    (a_step,) = [so for so in worker.steps if so["finished_req_ids"] == ["a"]]
    assert a_step["num_scheduled_tokens"] == {"b": 1}
    last = worker.steps[-1]
    assert last["total_num_scheduled_tokens"] == 0 and last["finished_req_ids"] == ["b"]
    assert not worker.reqs
    assert [e.new_token_ids[0] for e in events if e.req_id == "b"] == done["b"].output_token_ids
    assert [(e.req_id, e.finish_reason) for e in events if e.finished] == [("a", "length"), ("b", "length")]
    assert all(r.first_token_time is not None for r in done.values())


def test_add_request_rejects_duplicates_and_oversized():
    sched = Scheduler(num_blocks=4, block_size=4)
    sched.add_request(Request("a", [1], {}, 4))
    with pytest.raises(ValueError):
        sched.add_request(Request("a", [2], {}, 4))
    with pytest.raises(ValueError):  # 10 + 8 - 1 positions need 5 blocks of 4
        sched.add_request(Request("big", list(range(10)), {}, 8))
    sched.add_request(Request("fits", list(range(10)), {}, 7))
    with pytest.raises(ValueError):
        Request("empty", [], {}, 4)
    with pytest.raises(ValueError):
        Request("zero", [1], {}, 0)


# -- the harness itself must be able to fail -------------------------------------------------------

def first_steps(n: int):
    """A worker and scheduler after n steps of a two-request workload with a prefix hit."""
    sched, worker = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(Request("a", list(range(1, 10)), {}, 8))
    for _ in range(n):
        out = sched.schedule()
        sched.update_from_output(out, worker(out))
    return sched, worker


def test_fake_worker_rejects_a_wrong_prefix_hit():
    sched, worker = first_steps(2)
    sched.add_request(Request("b", list(range(1, 9)) + [0, 0], {}, 2))
    out = sched.schedule()
    (nr,) = out["scheduled_new_reqs"]
    assert nr["num_computed_tokens"] == 8
    bad = copy.deepcopy(out)
    bad["scheduled_new_reqs"][0]["block_ids"][0][:2] = bad["scheduled_new_reqs"][0]["block_ids"][0][1::-1]
    with pytest.raises(WireError, match="stale K/V"):
        copy.deepcopy(worker)(bad)
    worker(out)  # the unmodified step passes


@pytest.mark.parametrize("mutation",
                         ["short_table", "shared_write", "double_write", "not_resumed", "total", "new_twice"])
def test_fake_worker_rejects_bad_steps(mutation):
    sched, worker = first_steps(1)
    sched.add_request(Request("b", [7, 7, 7], {}, 4))
    out = sched.schedule()
    bad = copy.deepcopy(out)
    c = bad["scheduled_cached_reqs"]
    match = {"short_table": "too short", "shared_write": "writes block", "double_write": "written by",
             "not_resumed": "resumed without",
             "total": "total_num", "new_twice": "already exists"}[mutation]
    if mutation == "short_table":
        bad["scheduled_new_reqs"][0]["block_ids"][0] = []
    elif mutation == "shared_write":  # a block a holds but doesn't write this step
        bad["scheduled_new_reqs"][0]["block_ids"][0][0] = worker.reqs["a"].table[0]
    elif mutation == "double_write":  # the block a's decode writes
        bad["scheduled_new_reqs"][0]["block_ids"][0][0] = worker.reqs["a"].table[-1]
    elif mutation == "not_resumed":
        c["resumed_req_ids"] = ["a"]
    elif mutation == "total":
        bad["total_num_scheduled_tokens"] += 1
    elif mutation == "new_twice":
        bad["scheduled_new_reqs"][0]["req_id"] = "a"
    with pytest.raises(WireError, match=match):
        copy.deepcopy(worker)(bad)
    worker(out)


def test_scheduler_rejects_a_token_for_a_prefill_chunk():
    sched, worker = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    sched.add_request(Request("a", list(range(10)), {}, 4))
    out = sched.schedule()
    res = worker(out)
    assert res["sampled_token_ids"] == [[]]
    with pytest.raises(ValueError):
        sched.update_from_output(out, dict(res, sampled_token_ids=[[3]]))
