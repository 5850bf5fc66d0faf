"""The decode step's fast path decodes exactly as the full decode, and declines everything else."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

import sidecar.protocol as protocol
from sidecar.errors import ProtocolError
from sidecar.protocol import SchedulerOutput
from sidecar.wire_fast import cached_step


def step(**over: Any) -> dict:
    d = {
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": {"req_ids": ["a", "b"], "resumed_req_ids": [], "new_token_ids": [[], [-1]],
                                  "new_block_ids": [None, [[7]]], "num_computed_tokens": [40, 9],
                                  "num_output_tokens": [3, 1]},
        "num_scheduled_tokens": {"a": 1, "b": 1}, "total_num_scheduled_tokens": 2,
        "scheduled_spec_decode_tokens": {}, "num_common_prefix_blocks": [0],
        "finished_req_ids": ["z"], "preempted_req_ids": [],
    }
    d.update(over)
    return d


def cached(**over: Any) -> Callable[[dict], None]:
    return lambda d: d["scheduled_cached_reqs"].update(over)


def outcome(d: Any, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(protocol, "cached_step", lambda d: None)
        try:
            return "ok", SchedulerOutput.from_wire(copy.deepcopy(d), vocab_size=100, max_logprobs=5)
        except ProtocolError as e:
            return "error", str(e), e.field


# Bodies the fast path takes: each decodes to what the full decode gives.
TAKEN: list[tuple[str, Callable[[dict], None]]] = [
    ("as the reference scheduler sends it", lambda d: None),
    ("optional fields missing", lambda d: [d.pop(k) for k in ("scheduled_new_reqs", "scheduled_spec_decode_tokens",
                                                             "finished_req_ids", "preempted_req_ids")]),
    ("optional fields null", lambda d: d.update(scheduled_new_reqs=None, finished_req_ids=None, preempted_req_ids=None,
                                                scheduled_spec_decode_tokens=None, kv_cache_block_copies=None)),
    ("vLLM's empty new_token_ids", cached(new_token_ids=[])),
    ("new_token_ids missing", lambda d: d["scheduled_cached_reqs"].pop("new_token_ids")),
    ("new_block_ids and num_computed_tokens missing",
     lambda d: [d["scheduled_cached_reqs"].pop(k) for k in ("new_block_ids", "num_computed_tokens")]),
    ("stated tokens", cached(new_token_ids=[[5, 6], [8]])),
    ("two groups of new blocks", cached(new_block_ids=[[[1, 2], [3]], None])),
    ("no cached requests: an empty step", lambda d: d.update(
        scheduled_cached_reqs={"req_ids": [], "new_token_ids": [], "new_block_ids": [], "num_computed_tokens": []},
        num_scheduled_tokens={}, total_num_scheduled_tokens=0)),
    ("no scheduled_cached_reqs at all", lambda d: d.update(scheduled_cached_reqs=None, num_scheduled_tokens={},
                                                          total_num_scheduled_tokens=0)),
    ("counts that don't add up (plan_step's to reject, as before)", lambda d: d.update(total_num_scheduled_tokens=5)),
]

# Bodies it declines: the full decode answers, and with or without the fast path the answer is the same.
DECLINED: list[tuple[str, Callable[[dict], None]]] = [
    ("a new request", lambda d: d.update(scheduled_new_reqs=[{"req_id": "n", "prompt_token_ids": [1],
                                                             "block_ids": [[0]]}])),
    ("drafts", lambda d: d.update(scheduled_spec_decode_tokens={"a": [1, 2]})),
    ("block copies", lambda d: d.update(kv_cache_block_copies=[[1, 2]])),
    ("a resumed request", cached(resumed_req_ids=["a"])),
    ("older resumed flags", cached(resumed_from_preemption=[False, False])),
    ("all_token_ids", cached(all_token_ids={"a": [1, 2]})),
    ("a bool count", lambda d: d.update(num_scheduled_tokens={"a": True, "b": 1})),
    ("a float count", lambda d: d.update(num_scheduled_tokens={"a": 1.0, "b": 1})),
    ("a bool total", lambda d: d.update(total_num_scheduled_tokens=True)),
    ("no total", lambda d: d.pop("total_num_scheduled_tokens")),
    ("a null total", lambda d: d.update(total_num_scheduled_tokens=None)),
    ("no counts", lambda d: d.pop("num_scheduled_tokens")),
    ("counts not a map", lambda d: d.update(num_scheduled_tokens=[1, 1])),
    ("a non-string req id", cached(req_ids=["a", 3])),
    ("req_ids not an array", cached(req_ids="ab")),
    ("a bool token", cached(new_token_ids=[[True], []])),
    ("a token list too short", cached(new_token_ids=[[]])),
    ("tokens not arrays", cached(new_token_ids=[1, 2])),
    ("a bool block id", cached(new_block_ids=[None, [[True]]])),
    ("a block table not an array", cached(new_block_ids=[None, [7]])),
    ("block groups not an array", cached(new_block_ids=[None, 7])),
    ("block lists too short", cached(new_block_ids=[None])),
    ("a float computed count", cached(num_computed_tokens=[40.0, 9])),
    ("computed counts too long", cached(num_computed_tokens=[40, 9, 1])),
    ("a non-string finished id", lambda d: d.update(finished_req_ids=[1])),
    ("preempted ids not an array", lambda d: d.update(preempted_req_ids="a")),
    ("scheduled_cached_reqs not a map", lambda d: d.update(scheduled_cached_reqs=[])),
    ("new requests not an array", lambda d: d.update(scheduled_new_reqs={})),
    ("drafts not a map", lambda d: d.update(scheduled_spec_decode_tokens=[])),
]


@pytest.mark.parametrize("name, mutate", TAKEN, ids=[n for n, _ in TAKEN])
def test_taken_bodies_decode_as_the_full_decode(name: str, mutate: Callable[[dict], None],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = step()
    mutate(d)
    assert cached_step(d) is not None
    fast, full = outcome(d, True, monkeypatch), outcome(d, False, monkeypatch)
    assert fast[0] == "ok" and fast == full


@pytest.mark.parametrize("name, mutate", DECLINED, ids=[n for n, _ in DECLINED])
def test_declined_bodies_get_the_full_decodes_answer(name: str, mutate: Callable[[dict], None],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d = step()
    mutate(d)
    assert cached_step(d) is None
    assert outcome(d, True, monkeypatch) == outcome(d, False, monkeypatch)


def test_not_a_map_is_declined_and_rejected() -> None:
    for d in (None, [], "x", 3):
        assert cached_step(d) is None
        with pytest.raises(ProtocolError) as e:
            SchedulerOutput.from_wire(d, vocab_size=100, max_logprobs=5)
        assert e.value.field == "scheduler_output"


def test_the_comparison_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a fast path that dropped a field would not compare equal."""
    d = step()
    full = outcome(d, False, monkeypatch)
    monkeypatch.setattr(protocol, "cached_step", lambda d: (lambda f: (f[0], f[1], f[2], f[3], f[4], f[5], [], f[7]))(
        cached_step(d)))
    fast = outcome(d, True, monkeypatch)
    assert fast[0] == "ok" and fast != full
