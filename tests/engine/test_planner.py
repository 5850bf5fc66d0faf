from __future__ import annotations

import copy

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import SchedulerOutput
from sidecar.engine.planner import apply, plan_step
from sidecar.engine.state import RequestState
from sidecar.engine.sampler import SamplingParams

BS, NB, VOCAB = 4, 10, 50


def new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0) -> dict:
    return {"req_id": rid, "prompt_token_ids": prompt, "sampling_params": {}, "block_ids": [blocks],
            "num_computed_tokens": computed}


def so(new_reqs=(), cached=None, nst=None, total=None, finished=(), preempted=()) -> SchedulerOutput:
    nst = nst or {}
    d = {"scheduled_new_reqs": list(new_reqs), "scheduled_cached_reqs": cached or {}, "num_scheduled_tokens": nst,
         "total_num_scheduled_tokens": sum(nst.values()) if total is None else total,
         "finished_req_ids": list(finished), "preempted_req_ids": list(preempted)}
    return SchedulerOutput.from_wire(d, vocab_size=VOCAB, max_logprobs=5)


def cached(rids, computed, new_blocks=None, resumed=()) -> dict:
    return {"req_ids": list(rids), "resumed_req_ids": list(resumed), "new_token_ids": [[] for _ in rids],
            "new_block_ids": new_blocks or [None] * len(rids), "num_computed_tokens": list(computed)}


def plan(reqs, out):
    return plan_step(reqs, out, num_blocks=NB, block_size=BS, vocab_size=VOCAB, max_model_len=64)


@pytest.fixture
def reqs() -> dict[str, RequestState]:
    # "a": prompt of 6 fully computed plus one sampled token; blocks 0, 1.
    a = RequestState("a", [1, 2, 3, 4, 5, 6], SamplingParams(), [0, 1], num_computed_tokens=6, output_token_ids=[7])
    return {"a": a}


def test_new_and_cached_rows(reqs) -> None:
    p = plan(reqs, so([new("b", [1, 2, 3, 4, 5], [2, 3])], cached(["a"], [6]), {"b": 4, "a": 1}))
    rows = {r.state.req_id: r for r in p.rows}
    assert (rows["b"].start, rows["b"].token_ids, rows["b"].sample) == (0, [1, 2, 3, 4], False)
    assert (rows["a"].start, rows["a"].token_ids, rows["a"].sample) == (6, [7], True)
    apply(reqs, p)
    assert reqs["b"].num_computed_tokens == 4 and reqs["a"].num_computed_tokens == 7


def test_resumed_request_replaces_its_table(reqs) -> None:
    p = plan(reqs, so(cached=cached(["a"], [0], [[[5, 6]]], resumed=["a"]), nst={"a": 7}))
    apply(reqs, p)
    assert reqs["a"].block_ids == [5, 6]
    assert p.rows[0].token_ids == [1, 2, 3, 4, 5, 6, 7] and p.rows[0].sample


def test_cached_request_appends_blocks(reqs) -> None:
    p = plan(reqs, so(cached=cached(["a"], [6], [[[4]]]), nst={"a": 1}))
    apply(reqs, p)
    assert reqs["a"].block_ids == [0, 1, 4]


@pytest.mark.parametrize("computed, n, stated, added, want", [
    (6, 1, [], None, [7]),  # a plain decode
    (6, 1, [-1], None, [7]),  # the pipelined placeholder for the last sampled token
    (6, 1, [], [[4]], [7]),  # with a new block
    (5, 2, [], None, [6, 7]),  # a recompute of the last two tokens
])
def test_decode_steps_are_planned(reqs, computed: int, n: int, stated: list, added, want: list[int]) -> None:
    p = plan(reqs, so(cached=dict(cached(["a"], [computed], [added]), new_token_ids=[stated]), nst={"a": n}))
    (row,) = p.rows
    assert (row.start, row.token_ids, row.sample, row.num_draft) == (computed, want, True, 0)
    apply(reqs, p)
    assert reqs["a"].num_computed_tokens == 7 and reqs["a"].block_ids == [0, 1] + (added[0] if added else [])


def test_finished_first_then_same_id_may_be_new(reqs) -> None:
    p = plan(reqs, so([new("a", [9, 9], [3])], nst={"a": 2}, finished=["a", "never-seen"]))
    apply(reqs, p)
    assert reqs["a"].prompt_token_ids == [9, 9]


@pytest.mark.parametrize("make, field", [
    (lambda: so(cached=cached(["zz"], [0]), nst={"zz": 1}), "scheduled_cached_reqs.req_ids[0]"),
    (lambda: so([new("a", [1], [2])], nst={"a": 1}), "scheduled_new_reqs[0].req_id"),
    (lambda: so([new("b", [1], [2]), new("b", [1], [3])], nst={"b": 1}), "scheduled_new_reqs[1].req_id"),
    (lambda: so([new("b", [1, 2], [NB])], nst={"b": 2}), "scheduled_new_reqs[0].block_ids[0][0]"),
    (lambda: so([new("b", [1, 2], [-1])], nst={"b": 2}), "scheduled_new_reqs[0].block_ids[0][0]"),
    (lambda: so([new("b", [1] * 6, [2])], nst={"b": 6}), "scheduled_new_reqs[0].block_ids[0]"),
    (lambda: so([new("b", [1, 2], [2])], nst={"b": 3}), "scheduled_new_reqs[0].num_computed_tokens"),
    (lambda: so([new("b", [1, VOCAB], [2])], nst={"b": 2}), "scheduled_new_reqs[0].prompt_token_ids[1]"),
    (lambda: so([new("b", [1, 2], [2])], nst={"b": 2}, total=5), "total_num_scheduled_tokens"),
    (lambda: so([new("b", [1, 2], [2])], nst={"b": 2, "c": 1}), "num_scheduled_tokens.c"),
    (lambda: so([new("b", [1, 2], [2])], nst={}), "num_scheduled_tokens.b"),
    (lambda: so(cached=cached(["a"], [6]), nst={"a": 2}), "scheduled_cached_reqs.num_computed_tokens[0]"),
    (lambda: so(cached=cached(["a"], [0], [[[5]]], resumed=["a"]), nst={"a": 7}), "scheduled_cached_reqs.new_block_ids[0]"),
    (lambda: so(cached=cached(["a"], [0], None, resumed=["a"]), nst={"a": 1}), "scheduled_cached_reqs.new_block_ids[0]"),
    (lambda: so(preempted=["zz"]), "preempted_req_ids[0]"),
    # decode steps (cached requests only)
    (lambda: so(cached=cached(["a", "a"], [6, 6]), nst={"a": 1}), "scheduled_cached_reqs.req_ids[1]"),
    (lambda: so(cached=cached(["a"], [6]), nst={"a": 0}), "num_scheduled_tokens.a"),
    (lambda: so(cached=cached(["a"], [-1]), nst={"a": 1}), "scheduled_cached_reqs.num_computed_tokens[0]"),
    (lambda: so(cached=dict(cached(["a"], [5]), new_token_ids=[[-1]]), nst={"a": 2}),
     "scheduled_cached_reqs.new_token_ids[0]"),  # a placeholder stands for the last token only
    (lambda: so(cached=cached(["a"], [6], [[[NB]]]), nst={"a": 1}), "scheduled_cached_reqs.new_block_ids[0][2]"),
    (lambda: so(cached=cached(["a"], [6], [[[-1]]]), nst={"a": 1}), "scheduled_cached_reqs.new_block_ids[0][2]"),
    (lambda: so(cached=cached(["a"], [6], [[[3], [4]]]), nst={"a": 1}), "scheduled_cached_reqs.new_block_ids[0]"),
])
def test_violations_are_rejected_and_change_nothing(reqs, make, field: str) -> None:
    before = copy.deepcopy(reqs)
    with pytest.raises(ProtocolError) as e:
        plan(reqs, make())
    assert e.value.field == field, e.value.message
    assert reqs == before


def test_one_bad_row_rejects_the_whole_batch(reqs) -> None:
    before = copy.deepcopy(reqs)
    bad = so([new("ok", [1, 2], [3]), new("bad", [1, 2], [NB + 5])], cached(["a"], [6]), {"ok": 2, "bad": 2, "a": 1})
    with pytest.raises(ProtocolError):
        plan(reqs, bad)
    assert reqs == before and "ok" not in reqs
