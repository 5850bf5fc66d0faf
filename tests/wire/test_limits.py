"""Shape bounds of a step (sidecar/wire/limits.py), checked on the raw map before decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.limits import Limits, check_step_shape

LIM = Limits(max_model_len=64, block_size=16, max_live_requests=2, max_req_id_len=8, vocab_size=100)


def new(rid: str, blocks: int = 1, **sp: object) -> dict:
    return {"req_id": rid, "prompt_token_ids": [1], "block_ids": [list(range(blocks))], "sampling_params": sp}


def field(so: dict, requests: dict | None = None) -> str | None:
    try:
        check_step_shape(so, requests or {}, LIM)
    except ProtocolError as e:
        return e.field
    return None


def test_each_bound_names_its_field() -> None:
    assert LIM.max_table_len == 8
    assert field({"scheduled_new_reqs": [new("a", 8)]}) is None  # at the limit: fine
    assert field({"scheduled_new_reqs": [new("a", 9)]}) == "scheduled_new_reqs[0].block_ids[0]"
    assert field({"scheduled_new_reqs": [{"block_ids": [[]] * 17}]}) == "scheduled_new_reqs[0].block_ids"
    assert field({"scheduled_new_reqs": [new("a" * 9)]}) == "scheduled_new_reqs[0].req_id"
    assert field({"scheduled_new_reqs": [{"prompt_token_ids": [0] * 65}]}) == "scheduled_new_reqs[0].prompt_token_ids"
    assert field({"scheduled_new_reqs": [new("a", allowed_token_ids=[1] * 101)]}) == (
        "scheduled_new_reqs[0].sampling_params.allowed_token_ids")
    assert field({"scheduled_new_reqs": [new("a", bad_words_token_ids=[[1] * 65])]}) == (
        "scheduled_new_reqs[0].sampling_params.bad_words_token_ids[0]")
    assert field({"finished_req_ids": ["123456789"]}) == "finished_req_ids[0]"
    assert field({"scheduled_cached_reqs": {"req_ids": ["a"], "new_token_ids": [[], []]}}) == (
        "scheduled_cached_reqs.new_token_ids")


def test_live_requests_and_appended_tables() -> None:
    held = {"a": SimpleNamespace(block_ids=[0] * 7)}
    assert field({"scheduled_new_reqs": [new("b")]}, held) is None
    assert field({"scheduled_new_reqs": [new("b"), new("c")]}, held) == "scheduled_new_reqs"
    assert field({"scheduled_new_reqs": [new("b"), new("c")], "finished_req_ids": ["a", "a"]}, held) is None
    grow = {"scheduled_cached_reqs": {"req_ids": ["a"], "new_block_ids": [[[1, 2]]]}}
    assert field(grow, held) == "scheduled_cached_reqs.new_block_ids[0][0]"
    grow["scheduled_cached_reqs"]["resumed_req_ids"] = ["a"]  # a resumed table replaces the old one
    assert field(grow, held) is None


@pytest.mark.parametrize("junk", [None, 1, "x", [], [1, None], {"scheduled_new_reqs": 5},
                                  {"scheduled_cached_reqs": {"req_ids": 3, "new_block_ids": 4, "new_token_ids": "x"}},
                                  {"finished_req_ids": [[1]], "scheduled_new_reqs": [None, {"block_ids": 1}]}])
def test_wrong_types_are_left_for_the_decoder(junk: object) -> None:
    check_step_shape(junk, {}, LIM)


# --- the decode step: bounds on the rows of scheduled_cached_reqs --------------------------------


def decode(**over: object) -> dict:
    d = {"scheduled_new_reqs": [],
         "scheduled_cached_reqs": {"req_ids": ["a"], "resumed_req_ids": [], "new_token_ids": [[]],
                                   "new_block_ids": [None], "num_computed_tokens": [5], "num_output_tokens": [2]},
         "num_scheduled_tokens": {"a": 1}, "total_num_scheduled_tokens": 1, "finished_req_ids": [],
         "preempted_req_ids": [], "scheduled_spec_decode_tokens": {}}
    d.update(over)
    return d


def _cached(**over: object):
    return lambda d: d["scheduled_cached_reqs"].update(over)


HELD = {"a": SimpleNamespace(block_ids=[0] * 7), "b": SimpleNamespace(block_ids=[1])}


@pytest.mark.parametrize("mutate, where", [
    (lambda d: None, None), (_cached(new_token_ids=[]), None), (_cached(new_block_ids=[[[3]]]), None),
    (_cached(new_token_ids=[[0] * 64]), None),
    (lambda d: d.update(finished_req_ids=["b"], preempted_req_ids=["a"]), None),
    (_cached(new_block_ids=[[[3, 4]]]), "scheduled_cached_reqs.new_block_ids[0][0]"),  # 7 + 2 blocks: over 8
    (_cached(new_block_ids=[[[3]] * 17]), "scheduled_cached_reqs.new_block_ids[0]"),
    (_cached(new_block_ids=[{str(i): 1 for i in range(17)}]), "scheduled_cached_reqs.new_block_ids[0]"),
    (_cached(new_token_ids=[[0] * 65]), "scheduled_cached_reqs.new_token_ids[0]"),
    (_cached(new_token_ids=[[], []]), "scheduled_cached_reqs.new_token_ids"),
    (_cached(num_output_tokens=[1, 2]), "scheduled_cached_reqs.num_output_tokens"),
    (_cached(req_ids=["a" * 9]), "scheduled_cached_reqs.req_ids[0]"),
    (_cached(req_ids=["a", "b", "c"]), "scheduled_cached_reqs.req_ids"),
    (lambda d: d.update(num_scheduled_tokens={"a": 1, "b": 1}), "num_scheduled_tokens"),
    (lambda d: d.update(finished_req_ids=["123456789"]), "finished_req_ids[0]"),
    (_cached(resumed_req_ids=["a"], new_block_ids=[[[3, 4]]]), None),  # a resumed table replaces the old one
])
def test_decode_rows_are_bounded(mutate, where: str | None) -> None:
    d = decode()
    mutate(d)
    assert field(d, HELD) == where


def test_the_live_request_bound_holds_for_decodes() -> None:
    three = {**HELD, "c": SimpleNamespace(block_ids=[])}  # one over --max-live-requests (2) already
    assert field(decode(), three) == "scheduled_new_reqs"
    assert field(decode(finished_req_ids=["c"]), three) is None  # dropping one brings it back


def test_bad_words_are_bounded_in_total_tokens() -> None:
    """Each step compares every bad word with the output: their tokens together are bounded."""
    at = {"scheduled_new_reqs": [new("a", bad_words_token_ids=[[1] * 64] * 1024)]}  # 65536 tokens: the limit
    assert field(at) is None
    over = {"scheduled_new_reqs": [new("a", bad_words_token_ids=[[1] * 64] * 1024 + [[2]])]}
    assert field(over) == "scheduled_new_reqs[0].sampling_params.bad_words_token_ids"


def test_a_steps_tokens_are_bounded() -> None:
    """At most max(max_num_batched_tokens, max_model_len) tokens: else 1024 live requests could
    each prefill max_model_len tokens in one forward. Checked on decode-only steps too."""
    lim = Limits(max_model_len=64, block_size=16, max_num_batched_tokens=128)
    assert lim.max_step_tokens == 128 and Limits(max_model_len=64, block_size=16).max_step_tokens == 64

    def at(total: int, so: dict) -> str | None:
        try:
            check_step_shape({**so, "total_num_scheduled_tokens": total}, {}, lim)
        except ProtocolError as e:
            return e.field
        return None

    for so in ({"scheduled_new_reqs": [new("a")]}, {"scheduled_cached_reqs": {"req_ids": ["a"]}}):
        assert at(128, so) is None
        assert at(129, so) == "total_num_scheduled_tokens"
