"""The reference scheduler asking for several decode steps per call (`num_decode_steps`), driving a
real in-process worker: the same tokens and finish reasons as one step at a time through arrivals,
stops, chunked prefill, prefix hits and preemption in a pool too small for every request's extra
blocks, a new request's first token in a call of its own, and no pipelining of such calls."""

from __future__ import annotations

import random
from collections import deque

from sidecar.scheduler import Event, Request, Scheduler, run
from sidecar.scheduler.pipelined import run_pipelined
from tests.conftest import mlx_lm_greedy


def _workload(seed: int, n: int = 6) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # some prompts share a prefix: prefix hits
    return [((shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))],
             rng.randrange(1, 30)) for i in range(n)]


def _generate(w, workload, steps: int, *, num_blocks: int = 64, budget: int = 32, stop: tuple[int, ...] = ()):
    """Half the requests up front, the rest arriving as tokens come back; returns
    ({req_id: (tokens, finish reason)}, the steps sent, the scheduler)."""
    sched = Scheduler(num_blocks=num_blocks, block_size=w.config.block_size, max_num_batched_tokens=budget,
                      max_num_seqs=4, eos_token_ids=w.get_model()["eos_token_ids"],
                      max_model_len=w.runner.max_model_len, num_decode_steps=steps)
    later = deque(Request(f"r{i}", p, {"temperature": 0.0}, m, stop_token_ids=stop) for i, (p, m) in enumerate(workload))
    for _ in range(len(later) // 2):
        sched.add_request(later.popleft())
    sent: list[dict] = []

    def execute(so: dict) -> dict:
        sent.append(so)
        return w.execute_model(so).to_wire()

    def arrive(_: Event) -> None:
        if later:
            sched.add_request(later.popleft())

    done = run(sched, execute, on_event=arrive)
    assert not w.runner.requests and not later
    sched.blocks.check([])  # every block back, the prefix cache consistent
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in done.items()}, sent, sched


def test_several_steps_a_call_give_the_tokens_of_one_at_a_time(make_worker, oracle_model) -> None:
    w = make_worker(num_blocks=64)
    work = _workload(0)
    one, sent_one, _ = _generate(w, work, 1)
    many, sent, _ = _generate(w, work, 8)
    assert many == one
    oracle = oracle_model("builtin:tiny")
    assert [one[f"r{i}"][0] for i in range(len(work))] == [mlx_lm_greedy(oracle, p, len(one[f"r{i}"][0]))[0]
                                                           for i, (p, _) in enumerate(work)]
    multi = [so for so in sent if so.get("num_decode_steps", 1) > 1]
    assert multi and len(sent) < len(sent_one)
    # A call that admits a request returns its first token at once (not after further decode steps)
    assert not any(so["scheduled_new_reqs"] for so in multi)


def test_a_stop_id_inside_a_call_ends_the_request_as_one_step_at_a_time(make_worker) -> None:
    w = make_worker(num_blocks=64)
    work = _workload(1)
    free, _, _ = _generate(w, work, 1)
    tokens = [t for out, _ in free.values() for t in out[2:]]
    stop = (max(set(tokens), key=tokens.count),)  # the token the requests produce most, past their 2nd
    one, _, _ = _generate(w, work, 1, stop=stop)
    many, _, _ = _generate(w, work, 6, stop=stop)
    assert many == one
    assert sum(reason == "stop" for _, reason in one.values()) >= 2


def test_a_short_pool_keeps_the_tokens(make_worker) -> None:
    """A pool too small for every request's extra blocks: a call decodes each row as far as the
    blocks it got, requests are preempted and resumed, and the tokens are still those of one step at a time."""
    w = make_worker(num_blocks=8)
    work = _workload(2, 8)
    one, sent_one, _ = _generate(w, work, 1, num_blocks=8)
    many, sent, _ = _generate(w, work, 16, num_blocks=8)
    assert many == one
    assert any(so["preempted_req_ids"] for so in sent) and any(so["preempted_req_ids"] for so in sent_one)
    assert any(so.get("num_decode_steps", 1) > 1 for so in sent)


def test_pipelining_never_sends_a_step_ahead_of_a_multi_step_call(make_worker) -> None:
    w = make_worker(num_blocks=64)
    work = _workload(3, 3)
    one, _, _ = _generate(w, work, 1)
    sched = Scheduler(num_blocks=64, block_size=w.config.block_size, max_num_batched_tokens=32, max_num_seqs=4,
                      eos_token_ids=w.get_model()["eos_token_ids"], num_decode_steps=4)
    for i, (p, m) in enumerate(work):
        sched.add_request(Request(f"r{i}", p, {"temperature": 0.0}, m))
    replies: deque = deque()
    sent: list[dict] = []

    def submit(so: dict) -> None:
        sent.append(so)
        replies.append(w.execute_model(so).to_wire())

    done = run_pipelined(sched, submit, replies.popleft)
    assert {rid: (r.output_token_ids, r.finish_reason) for rid, r in done.items()} == one
    for prev, nxt in zip(sent, sent[1:]):  # a placeholder step only ever follows a one-step call
        if any(t == [-1] for t in nxt["scheduled_cached_reqs"]["new_token_ids"]):
            assert prev.get("num_decode_steps", 1) == 1
    assert any(so.get("num_decode_steps", 1) > 1 for so in sent)
