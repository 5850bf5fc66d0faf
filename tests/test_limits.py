"""Shape bounds of a step (sidecar/limits.py), checked on the raw map before decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sidecar.errors import ProtocolError
from sidecar.limits import Limits, check_step_shape

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
