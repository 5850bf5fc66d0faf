"""Random corruptions of valid steps: every one is either accepted or rejected with a 4xx
ProtocolError naming a field, and a rejected one changes nothing (the process never crashes)."""

from __future__ import annotations

import copy
import random
from typing import Callable

from sidecar.errors import ProtocolError
from tests.driver import Driver

JUNK = [None, True, -1, 0, 2**31, 2**63 - 1, -(2**40), 1.5, float("nan"), "x", "", [], [[]], {}, {"a": 1}, [1, "2"], [-5]]


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(so: dict, rng: random.Random) -> dict:
    bad = copy.deepcopy(so)
    path = rng.choice(_paths(bad)[1:])
    parent = bad
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = rng.random()
    if action < 0.15 and isinstance(parent, dict):
        del parent[key]
    elif action < 0.3 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-100, -1, 1, 1000, 10**9])
    else:
        parent[key] = copy.deepcopy(rng.choice(JUNK))
    return bad


def _state(w) -> dict:
    return {rid: (s.num_computed_tokens, tuple(s.output_token_ids), tuple(s.block_ids))
            for rid, s in w.runner.requests.items()}


def _fresh(w, rng: random.Random) -> Driver:
    """Drop whatever the worker holds and start a driver with new requests."""
    if w.runner.requests:
        w.execute_model({"num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                         "finished_req_ids": list(w.runner.requests)})
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [rng.randrange(3, 500) for _ in range(20)], {"temperature": 0.8, "seed": 1, "top_k": 5, "logprobs": 2})
    d.add("b", [rng.randrange(3, 500) for _ in range(5)],
          {"temperature": 0.0, "presence_penalty": 0.5, "logit_bias": {"7": 1.0}, "prompt_logprobs": 1})
    d.step(chunk=8)
    return d


def test_corrupted_steps_are_rejected_cleanly(make_worker) -> None:
    w = make_worker(num_blocks=256)
    rng = random.Random(1234)
    d = _fresh(w, rng)
    accepted = rejected = 0
    while accepted + rejected < 400:
        if max(len(r.out) for r in d.reqs.values()) > 30:
            d = _fresh(w, rng)
        so = d.build(chunk=8)
        if rng.random() < 0.3:  # several decode steps in the call: its field is corrupted too
            so["num_decode_steps"] = rng.choice([2, 5])
        n, ran = run_corrupted(w, d, so, lambda: _mutate(so, rng))
        rejected += n
        if ran:
            accepted += 1  # a harmless corruption (an ignored field, another valid value)
            d = _fresh(w, rng)
    assert rejected > 200 and accepted > 0


def run_corrupted(w, d, so: dict, corrupt: Callable[[], dict], tries: int = 4) -> tuple[int, bool]:
    """Run up to `tries` corrupted copies of step `so` (from `corrupt()`): each rejected with a 400
    naming a field and nothing changed, after which the valid step still runs. Returns how many
    were rejected, and True when the last one was accepted instead (the worker ran it)."""
    for i in range(tries):
        bad = corrupt()
        before = _state(w)
        try:
            w.execute_model(bad)
        except ProtocolError as e:
            assert e.status == 400 and e.message and e.field, e.message
            assert _state(w) == before, (bad, e.message)
            continue
        return i, True
    d.commit(so, w.execute_model(so).to_wire())
    return tries, False
