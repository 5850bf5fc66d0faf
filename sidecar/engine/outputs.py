"""A step's output: the sampled tokens committed to request state, the wire `ModelRunnerOutput`
(logprobs, prompt logprobs, NaN counts) and the step's `StepStats`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sidecar.wire.protocol import LogprobsLists, ModelRunnerOutput, PromptLogprobs
from sidecar.engine.state import Row
from sidecar.engine.sampler import SampleResult, prompt_logprobs
from sidecar.engine.spec_decode import Verified


@dataclass
class StepStats:
    num_rows: int = 0
    num_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    first_token_latencies: tuple[float, ...] = ()
    draft_tokens: int = 0  # drafts verified in the step, and how many were accepted
    accepted_tokens: int = 0
    prefill_chunks: int = 0  # rows that computed a prompt chunk without sampling
    pooled_requests: int = 0  # pooling requests whose result the step returned
    more_decode_steps: int = 0  # decode steps the call ran after its first (multistep.py)


def build_output(rows: list[Row], res: SampleResult, verified: Verified | None,
                 prompt_lp: dict, pooled: list | None = None) -> tuple[ModelRunnerOutput, StepStats]:
    """Commit each sampling row's tokens to its request state and build the step's output."""
    now = time.monotonic()
    sampled: list[list[int]] = []
    ttfts = []
    for i, (r, tok) in enumerate(zip(rows, res.token_ids)):
        if r.sample:
            s = r.state
            toks = [int(tok)] if verified is None else verified.token_ids[i]
            s.output_token_ids.extend(toks)
            s.num_computed_tokens -= r.num_draft - (len(toks) - 1)  # the scheduler's rollback
            if s.first_token_at is None:
                s.first_token_at = now
                ttfts.append(now - s.first_seen)
            sampled.append(toks)
        else:
            sampled.append([])
    req_ids = [r.state.req_id for r in rows]
    logprobs = None
    if verified is not None:
        if verified.logprob_token_ids is not None:
            logprobs = LogprobsLists(verified.logprob_token_ids, verified.logprobs,  # type: ignore[arg-type]
                                     verified.sampled_token_ranks, verified.cu_num_generated_tokens)  # type: ignore[arg-type]
    elif res.logprob_token_ids is not None:
        logprobs = LogprobsLists(res.logprob_token_ids, res.logprobs, res.sampled_token_ranks)  # type: ignore[arg-type]
    plp_dict: dict[str, LogprobsLists | PromptLogprobs | None] = {}
    for i, (lg, targets) in prompt_lp.items():
        ids, lps, ranks = prompt_logprobs(lg, targets, rows[i].state.sampling_params.prompt_logprobs)  # type: ignore[arg-type]
        if rows[i].state.sampling_params.prompt_logprobs_whole:
            if rows[i].start == 0:  # a recomputation (after preemption) starts over
                rows[i].state.prompt_lp_parts.clear()
            rows[i].state.prompt_lp_parts.append((ids, lps, ranks))
        else:
            plp_dict[req_ids[i]] = LogprobsLists(ids, lps, ranks)
    for i, r in enumerate(rows):  # v2: whole, in the step that samples the first token
        sp = r.state.sampling_params
        if (r.sample and sp.prompt_logprobs is not None and sp.prompt_logprobs_whole
                and len(r.state.output_token_ids) == len(sampled[i])):
            parts = r.state.prompt_lp_parts
            plp_dict[req_ids[i]] = PromptLogprobs([x for p in parts for x in p[0]], [x for p in parts for x in p[1]],
                                                  [x for p in parts for x in p[2]])
            r.state.prompt_lp_parts = []
    nans = {rid: n for rid, n in zip(req_ids, res.num_nans) if n}
    prompt_tokens = sum(max(0, min(r.end, len(r.state.prompt_token_ids)) - r.start) for r in rows)
    stats = StepStats(len(rows), sum(len(r.token_ids) for r in rows), prompt_tokens,
                      sum(map(len, sampled)), 0.0, tuple(ttfts),
                      verified.num_draft if verified else 0, verified.num_accepted if verified else 0,
                      prefill_chunks=sum(not r.sample and (r.state.pooling_params is None or
                                                          r.end < len(r.state.prompt_token_ids)) for r in rows),
                      pooled_requests=sum(v is not None for v in pooled or ()))
    out = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs_dict=plp_dict,
        num_nans_in_logits=nans or None, pooler_output=pooled,
    )
    return out, stats
