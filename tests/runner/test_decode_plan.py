"""decode_plan gives plan_step's own plan for a cached-only step, and steps aside for every other."""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any, Callable

import pytest

import sidecar.runner.decode_plan as decode_plan_module
from sidecar.errors import ProtocolError
from sidecar.protocol import SchedulerOutput
from sidecar.runner.decode_plan import decode_plan
from sidecar.runner.requests import RequestState, plan_step
from sidecar.runner.sampler import SamplingParams

BS, NB, VOCAB, MAX_LEN = 4, 10, 50, 16


def states(groups: int = 1) -> dict[str, RequestState]:
    # "a": 6 prompt tokens + 2 sampled, blocks 0, 1 (positions 0-7); "b": 3 + 1 sampled, block 2.
    other = [[5, 6]] if groups == 2 else []
    return {"a": RequestState("a", [1, 2, 3, 4, 5, 6], SamplingParams(), [0, 1], 7, [7, 8], other_block_ids=other,
                              first_seen=0.0),
            "b": RequestState("b", [9, 8, 7], SamplingParams(), [2], 3, [4], other_block_ids=[[7]] if groups == 2 else [],
                              first_seen=0.0)}


def wire(**over: Any) -> dict:
    d = {"scheduled_new_reqs": [],
         "scheduled_cached_reqs": {"req_ids": ["a", "b"], "resumed_req_ids": [], "new_token_ids": [[], []],
                                   "new_block_ids": [None, None], "num_computed_tokens": [7, 3]},
         "num_scheduled_tokens": {"a": 1, "b": 1}, "total_num_scheduled_tokens": 2,
         "finished_req_ids": [], "preempted_req_ids": []}
    d.update(over)
    return d


def cached(**over: Any) -> Callable[[dict], None]:
    return lambda d: d["scheduled_cached_reqs"].update(over)


def outcome(reqs: dict, d: dict, lean: bool, monkeypatch: pytest.MonkeyPatch, groups: int = 1) -> tuple:
    out = SchedulerOutput.from_wire(copy.deepcopy(d), vocab_size=VOCAB, max_logprobs=5)
    with monkeypatch.context() as m:
        if not lean:
            m.setattr(decode_plan_module, "decode_plan", lambda *a, **k: None)
        try:
            got = plan_step(reqs, out, num_blocks=NB, block_size=BS, vocab_size=VOCAB, max_model_len=MAX_LEN,
                            num_groups=groups)
        except ProtocolError as e:
            return "error", str(e), e.field
    return "ok", re.sub(r"first_seen=[0-9.e+-]+", "", repr(got))  # (a new request's is the time it was planned)


def lean_plan(reqs: dict, d: dict, groups: int = 1, state_groups: frozenset[int] | None = None) -> Any:
    out = SchedulerOutput.from_wire(copy.deepcopy(d), vocab_size=VOCAB, max_logprobs=5)
    return decode_plan(reqs, out, num_blocks=NB, block_size=BS, max_model_len=MAX_LEN, state_groups=state_groups,
                       num_groups=groups)


TAKEN: list[tuple[str, Callable[[dict], None]]] = [
    ("two decodes", lambda d: None),
    ("one of them", lambda d: d.update(scheduled_cached_reqs={
        "req_ids": ["b"], "new_token_ids": [[]], "new_block_ids": [None], "num_computed_tokens": [3]},
        num_scheduled_tokens={"b": 1}, total_num_scheduled_tokens=1)),
    ("placeholders", cached(new_token_ids=[[-1], [-1]])),
    ("a new block", cached(new_block_ids=[[[3]], None])),
    ("a recompute of the last two tokens", lambda d: (cached(num_computed_tokens=[6, 3])(d),
                                                       d.update(num_scheduled_tokens={"a": 2, "b": 1},
                                                                total_num_scheduled_tokens=3))),
    ("an empty step", lambda d: d.update(scheduled_cached_reqs={}, num_scheduled_tokens={}, total_num_scheduled_tokens=0)),
]

DECLINED: list[tuple[str, Callable[[dict], None]]] = [
    ("a new request", lambda d: d.update(scheduled_new_reqs=[{"req_id": "n", "prompt_token_ids": [1], "block_ids": [[4]]}],
                                         num_scheduled_tokens={"a": 1, "b": 1, "n": 1}, total_num_scheduled_tokens=3)),
    ("a finished id", lambda d: d.update(finished_req_ids=["zz"])),
    ("a preempted id", lambda d: d.update(preempted_req_ids=["b"])),
    ("block copies", lambda d: d.update(kv_cache_block_copies=[[0, 3]])),
    ("drafts", lambda d: d.update(scheduled_spec_decode_tokens={"a": [3]}, num_scheduled_tokens={"a": 2, "b": 1},
                                  total_num_scheduled_tokens=3)),
    ("a resumed request", cached(resumed_req_ids=["a"], new_block_ids=[[[0, 1]], None])),
    ("all_token_ids", cached(all_token_ids={"a": [1, 2, 3, 4, 5, 6, 7]})),
    ("stated tokens", cached(new_token_ids=[[7], []])),
    # the rest are invalid: plan_step rejects them, and decode_plan must never plan them
    ("an unknown request", cached(req_ids=["a", "x"])),
    ("a request twice", lambda d: d.update(scheduled_cached_reqs={
        "req_ids": ["a", "a"], "new_token_ids": [[], []], "new_block_ids": [None, None], "num_computed_tokens": [7, 7]},
        num_scheduled_tokens={"a": 1, "b": 1})),
    ("a missing count", lambda d: d.update(num_scheduled_tokens={"a": 1, "c": 1})),
    ("an extra count", lambda d: d.update(num_scheduled_tokens={"a": 1, "b": 1, "c": 1}, total_num_scheduled_tokens=3)),
    ("a zero count", lambda d: d.update(num_scheduled_tokens={"a": 0, "b": 1}, total_num_scheduled_tokens=1)),
    ("a wrong total", lambda d: d.update(total_num_scheduled_tokens=3)),
    ("past the known tokens", lambda d: d.update(num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3)),
    ("a negative start", cached(num_computed_tokens=[-1, 3])),
    ("a placeholder not at the last token", lambda d: (cached(new_token_ids=[[-1], []], num_computed_tokens=[6, 3])(d),
                                                        d.update(num_scheduled_tokens={"a": 2, "b": 1},
                                                                 total_num_scheduled_tokens=3))),
    ("a block id out of range", cached(new_block_ids=[[[NB]], None])),
    ("a negative block id", cached(new_block_ids=[[[-1]], None])),
    ("two block lists for one group", cached(new_block_ids=[[[3], [4]], None])),
]


@pytest.mark.parametrize("name, mutate", TAKEN, ids=[n for n, _ in TAKEN])
def test_a_cached_only_step_gets_plan_steps_own_plan(name: str, mutate: Callable[[dict], None],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = wire()
    mutate(d)
    assert lean_plan(states(), d) is not None
    reqs = states()
    lean, full = outcome(reqs, d, True, monkeypatch), outcome(reqs, d, False, monkeypatch)
    assert lean[0] == "ok" and lean == full


@pytest.mark.parametrize("name, mutate", DECLINED, ids=[n for n, _ in DECLINED])
def test_any_other_step_is_left_to_plan_step(name: str, mutate: Callable[[dict], None],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    d = wire()
    mutate(d)
    assert lean_plan(states(), d) is None
    reqs = states()
    assert outcome(reqs, d, True, monkeypatch) == outcome(reqs, d, False, monkeypatch)


def test_the_invalid_ones_really_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the list above: from "an unknown request" on, plan_step raises."""
    first = next(i for i, (n, _) in enumerate(DECLINED) if n == "an unknown request")
    for name, mutate in DECLINED[first:]:
        d = wire()
        mutate(d)
        assert outcome(states(), d, False, monkeypatch)[0] == "error", name


def test_two_kv_cache_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    d = wire()
    cached(new_block_ids=[[[3], [8]], None])(d)
    assert lean_plan(states(2), d, groups=2) is not None
    assert outcome(states(2), d, True, monkeypatch, 2) == outcome(states(2), d, False, monkeypatch, 2)
    cached(new_block_ids=[[[3]], None])(d)  # one list for a request with two: plan_step's error
    assert lean_plan(states(2), d, groups=2) is None
    assert outcome(states(2), d, True, monkeypatch, 2)[0] == "error"


def test_recurrent_state_models_keep_the_full_plan() -> None:
    assert lean_plan(states(), wire(), state_groups=frozenset({0})) is None


def test_every_prefix_of_a_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions across block boundaries, each with and without its new block, up to max_model_len:
    lean == full, planned or rejected (both happen)."""
    seen = set()
    for pos, give in itertools.product(range(6, MAX_LEN + 1), (False, True)):
        reqs = {"a": RequestState("a", [1, 2, 3, 4, 5, 6], SamplingParams(), [0, 1, 3, 4][: -(-pos // BS)], pos,
                                  list(range(pos - 5)), first_seen=0.0)}
        nb = -(-(pos + 1) // BS)
        add = [[[5, 6, 7][: max(0, nb - len(reqs["a"].block_ids))]]] if give else [None]
        d = wire(scheduled_cached_reqs={"req_ids": ["a"], "new_token_ids": [[]], "new_block_ids": add,
                                        "num_computed_tokens": [pos]},
                 num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
        lean = outcome(reqs, d, True, monkeypatch)
        assert lean == outcome(reqs, d, False, monkeypatch), (pos, give)
        seen.add(lean[2] if lean[0] == "error" else "ok")
    assert seen == {"ok", "scheduled_cached_reqs.new_block_ids[0]"}  # planned; a table too short / past max_model_len
