"""Several decode steps in one call (`num_decode_steps` n): mlx-lm's generate loop behind one RPC.

After the scheduler's step has sampled, every row that sampled decodes its new token, and so on,
up to n tokens per row in the call, with no round trip in between. Each further step is the decode
the overlap already queued (overlap.py), so it is taken, not recomputed: one sync per token, as in
mlx-lm's `generate_step`. What one call saves is the per-call cost (transport, the scheduler's own
step), paid once per n tokens.

A row stops early where the scheduler would stop it (max_tokens; eos and stop ids once min_tokens
is reached; max_model_len), and where its block tables end: the scheduler gives each row blocks
for as many positions past its step as it wants decoded. Stop strings are the scheduler's: the
tokens after one are returned and dropped by the scheduler, which finishes the request.
"""

from __future__ import annotations

from dataclasses import fields
from itertools import accumulate
from typing import Any, Sequence

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from sidecar.engine.outputs import StepStats
from sidecar.engine.state import RequestState, Row


def check(out: SchedulerOutput, defer_sampling: bool) -> None:
    """Refuse what one call cannot combine with further decode steps, before anything changes."""
    if out.num_decode_steps == 1:
        return
    why = ("a grammar bitmask is sampled per step (defer_sampling)" if defer_sampling else
           "drafts are verified per step (scheduled_spec_decode_tokens)" if any(out.scheduled_spec_decode_tokens.values())
           else "disk KV tier transfers are planned per step (kv_store_load / kv_store_save)"
           if out.kv_store_load or out.kv_store_save else None)
    if why:
        raise ProtocolError(f"num_decode_steps > 1 is not offered here: {why}", field="num_decode_steps")


def stops(state: RequestState, token: int, eos: Sequence[int]) -> bool:
    """Whether the scheduler stops the request at its last sampled `token` (vLLM's rules)."""
    p, n = state.sampling_params, len(state.output_token_ids)
    if p.max_tokens is not None and n >= p.max_tokens:
        return True
    if n < p.min_tokens:
        return False
    return token in (p.stop_token_ids or ()) or (p.adds_eos and token in eos)


def next_rows(runner: Any, rows: Sequence[Row], out: ModelRunnerOutput, wants_logprobs: bool) -> list[Row]:
    """The decode of each row's token just sampled, for the rows that go on (state advanced as
    planner.apply does); none once the step's logprobs could no longer be given for every token."""
    bs, state_groups, nxt = runner.pool.block_size, runner.state_groups or (), []
    for r, toks in zip(rows, out.sampled_token_ids):
        s = r.state
        at = s.num_computed_tokens  # the new token's position
        if not toks or stops(s, toks[-1], runner.sampler.eos_token_ids) or at + 1 >= runner.max_model_len:
            continue
        if any(len(t) * bs <= at for g, t in enumerate(r.tables(len(runner.groups))) if g not in state_groups):
            continue  # no block for it: the scheduler asked for no more
        nxt.append(Row(s, at, [toks[-1]], s.block_ids, True, other_block_ids=s.other_block_ids))
    if wants_logprobs and not any(r.state.sampling_params.logprobs is not None for r in nxt):
        return []
    for r in nxt:
        r.state.num_computed_tokens = r.end
    return nxt


def run(runner: Any, rows: list[Row], first: ModelRunnerOutput, n: int) -> ModelRunnerOutput:
    """Decode on after the scheduler's step (`rows`, its output `first`), up to `n` tokens a row."""
    outs, stats = [first], [runner.last_stats]
    while len(outs) < n and (rows := next_rows(runner, rows, outs[-1], first.logprobs is not None)):
        outs.append(runner.decode_rows(rows, more=len(outs) + 1 < n))
        stats.append(runner.last_stats)
    total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(StepStats) if f.name != "first_token_latencies"}
    runner.last_stats = StepStats(**{**total, "num_rows": stats[0].num_rows,  # (the call's requests)
                                     "first_token_latencies": sum((s.first_token_latencies for s in stats), ()),
                                     "more_decode_steps": len(stats) - 1})
    return merge(outs)


def merge(outs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One output for the call: each request's tokens (and their logprobs, one row per token, by
    `cu_num_generated_tokens` as for drafts) over the steps, in the first step's request order."""
    first = outs[0]
    if len(outs) == 1:
        return first
    tokens: list[list[int]] = [[] for _ in first.req_ids]
    lp_rows: list[list[tuple[list[int], list[float], int]]] = [[] for _ in first.req_ids]
    nans: dict[str, int] = {}
    for out in outs:
        for j, rid in enumerate(out.req_ids):
            i, toks = first.req_id_to_index[rid], out.sampled_token_ids[j]
            tokens[i] += toks
            if out.logprobs is not None and toks:
                lp = out.logprobs
                lp_rows[i].append((lp.logprob_token_ids[j], lp.logprobs[j], lp.sampled_token_ranks[j]))
        for rid, k in (out.num_nans_in_logits or {}).items():
            nans[rid] = nans.get(rid, 0) + k
    logprobs = None
    if first.logprobs is not None:
        flat = [x for per in lp_rows for x in per]
        logprobs = LogprobsLists([x[0] for x in flat], [x[1] for x in flat], [x[2] for x in flat],
                                 [0, *accumulate(map(len, lp_rows))])
    return ModelRunnerOutput(first.req_ids, first.req_id_to_index, tokens, logprobs, first.prompt_logprobs_dict,
                             nans or None, first.pooler_output)
