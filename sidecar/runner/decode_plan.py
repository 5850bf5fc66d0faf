"""The decode step's plan without the general validator: cached requests only, nothing else.

`plan_step` (requests.py) handles every kind of step and names the first offending field; on a
small model its checks and closures are a visible share of a decode step. Nearly every step of a
stream only continues running requests: no new, finished, preempted or resumed ones, no drafts,
no block copies, no stated tokens (at most the pipelined placeholder). `decode_plan` plans exactly
that step with the same checks, and returns None for anything else, or at the first check that
fails: then `plan_step` runs as before and gives its plan or its error. So a step is accepted,
planned or rejected exactly as without it (tests/runner/test_decode_plan.py compares the two).
Plain Python, no MLX.
"""

from __future__ import annotations

from sidecar.protocol import SchedulerOutput
from sidecar.runner.placeholders import PLACEHOLDER
from sidecar.runner.requests import RequestState, Row, StepPlan


def decode_plan(requests: dict[str, RequestState], out: SchedulerOutput, *, num_blocks: int, block_size: int,
                max_model_len: int, state_groups: frozenset[int] | None, num_groups: int) -> StepPlan | None:
    """The plan `plan_step` would return for a step that only continues cached requests; None when
    the step is anything else or breaks any check (plan_step then answers)."""
    cached = out.scheduled_cached_reqs
    if (out.scheduled_new_reqs or out.finished_req_ids or out.preempted_req_ids or out.kv_cache_block_copies
            or out.scheduled_spec_decode_tokens or state_groups is not None or cached.resumed_req_ids
            or cached.all_token_ids):
        return None
    nst = out.num_scheduled_tokens
    req_ids = cached.req_ids
    if len(nst) != len(req_ids):
        return None
    seen: set[str] = set()
    rows: list[Row] = []
    updates: list[tuple[RequestState, list[list[int]], list[int] | None]] = []
    total = 0
    for i, rid in enumerate(req_ids):
        state = requests.get(rid)
        n = nst.get(rid)
        if state is None or n is None or n < 1 or rid in seen:
            return None
        seen.add(rid)
        total += n
        start = cached.num_computed_tokens[i]
        num_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        stated = cached.new_token_ids[i]
        if stated and (stated != PLACEHOLDER or not state.output_token_ids or start != num_tokens - 1):
            return None  # tokens stated by the scheduler, or a placeholder that is not the last token
        end = start + n
        if start < 0 or end > num_tokens or end > max_model_len:
            return None
        old = [state.block_ids, *state.other_block_ids]
        added = cached.new_block_ids[i]
        if added is None:
            tables = old
        else:
            if len(added) != len(old) or len(added) not in (1, num_groups):
                return None
            tables = []
            for have, new in zip(old, added):
                for b in new:
                    if not 0 <= b < num_blocks:
                        return None
                tables.append(have + new if new else have)
        need = -(-end // block_size)
        for table in tables:
            if len(table) < need:
                return None
        updates.append((state, tables, None))
        rows.append(Row(state, start, state.tokens(start, end), tables[0], end == num_tokens, num_draft=0,
                        other_block_ids=tables[1:]))
    if total != out.total_num_scheduled_tokens:
        return None
    return StepPlan(finished=[], new_states=[], updates=updates, rows=rows, preempted=[],
                    block_copies=out.kv_cache_block_copies)
