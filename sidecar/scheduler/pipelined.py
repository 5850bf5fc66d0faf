"""Two steps in flight (vLLM's async scheduling): step n + 1 is sent before step n's reply.

`schedule_ahead(scheduler, out)` builds step n + 1 from step n alone: every request step n
samples for decodes the token it is about to get, sent as the placeholder `[-1]`
(docs/protocol.md, "Pipelined steps"); the worker fills it from its own state. It is built only
when that is all the next step would do anyway: every row of step n samples, none has drafts or
reaches max_tokens / max_model_len with its next token, nothing is waiting, the blocks fit
without preemption, and step n is one decode step (no `num_decode_steps`). Otherwise None, and
the caller waits for step n's reply and schedules as usual. A request that stops (eos, a stop
id) in step n has one wasted token computed in n + 1, which `update_from_output` drops (it is no
longer running), as in vLLM. Plain Python, no MLX.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from sidecar.scheduler.scheduler import Event, Request, Scheduler, Status

PLACEHOLDER = [-1]


def _continues(s: Scheduler, req: Request | None, n: int, spec: dict) -> bool:
    return (req is not None and req.status is Status.RUNNING and not spec.get(req.req_id)
            and req.num_computed_tokens + n == req.num_tokens  # step n samples for it
            and len(req.output_token_ids) + 1 < req.max_tokens
            and (not s.max_model_len or req.num_tokens + 1 < s.max_model_len))


def schedule_ahead(s: Scheduler, out: dict) -> dict | None:
    """Step n + 1 for `out` (step n, whose reply is not in yet), or None (see the module doc)."""
    counts = out["num_scheduled_tokens"]
    spec = out.get("scheduled_spec_decode_tokens") or {}
    if not counts or s.waiting or out.get("num_decode_steps", 1) > 1:  # (how far step n decodes is the worker's)
        return None
    reqs = [s.requests.get(rid) for rid in counts]
    if not all(_continues(s, r, counts[r.req_id] if r else 0, spec) for r in reqs):
        return None
    # After step n a request has computed c + n tokens; step n + 1 writes position c + n.
    ends = [r.num_computed_tokens + counts[r.req_id] + 1 for r in reqs]  # type: ignore[union-attr]
    need = sum(max(0, s.blocks.blocks_for(e) - len(r.block_table)) for r, e in zip(reqs, ends))  # type: ignore[union-attr]
    if need > len(s.blocks.free_blocks):
        return None  # would preempt: leave it to the regular schedule
    new_blocks = []
    for r, e in zip(reqs, ends):
        have = len(r.block_table)  # type: ignore[union-attr]
        ok = s.blocks.append_slots(r, e - r.num_computed_tokens)  # type: ignore[union-attr, arg-type]
        assert ok
        new_blocks.append(r.block_table[have:] or None)  # type: ignore[union-attr]
    finished, s._finished_ids = s._finished_ids, []
    for req_id in finished:
        del s.requests[req_id]
    ids = [r.req_id for r in reqs]  # type: ignore[union-attr]
    return {
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": {
            "req_ids": ids, "resumed_req_ids": [],
            "new_token_ids": [list(PLACEHOLDER) for _ in ids],
            "new_block_ids": [None if b is None else [b] for b in new_blocks],
            "num_computed_tokens": [e - 1 for e in ends],
            "num_output_tokens": [len(r.output_token_ids) + 1 for r in reqs],  # type: ignore[union-attr]
        },
        "num_scheduled_tokens": {rid: 1 for rid in ids},
        "total_num_scheduled_tokens": len(ids),
        "scheduled_spec_decode_tokens": {},
        "num_common_prefix_blocks": [0],
        "finished_req_ids": finished,
        "preempted_req_ids": [],
    }


def run_pipelined(scheduler: Scheduler, submit: Callable[[dict], None], collect: Callable[[], dict],
                  on_event: Callable[[Event], None] | None = None) -> dict[str, Request]:
    """`run` with up to two steps in flight: `submit(out)` sends a step, `collect()` returns the
    oldest outstanding step's wire result (calls are answered in the order sent)."""
    seen: dict[str, Request] = {}
    inflight: deque[dict] = deque()
    while scheduler.has_unfinished() or scheduler.has_finished_ids() or inflight:
        seen.update(scheduler.requests)
        if not inflight:
            out = scheduler.schedule()
            submit(out)
            inflight.append(out)
        if len(inflight) == 1 and (ahead := schedule_ahead(scheduler, inflight[0])) is not None:
            submit(ahead)
            inflight.append(ahead)
        out = inflight.popleft()
        for event in scheduler.update_from_output(out, collect()):
            if on_event is not None:
                on_event(event)
    return seen
