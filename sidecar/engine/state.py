"""Per-request worker state and one step's plan: plain data, no validation, no MLX.

planner.py builds a `StepPlan` from a SchedulerOutput (validating it) and `apply` commits it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sidecar.wire.pooling_params import PoolingParams
from sidecar.wire.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The first KV cache group's block table. Tables are replaced, never edited in place: the
    # decode overlap and the metrics snapshot hold on to them.
    block_ids: list[int]
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: dict | None = None
    first_seen: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    preempted: bool = False  # listed in preempted_req_ids: a new request may take over its id (v2)
    prompt_lp_parts: list = field(default_factory=list)  # prompt_logprobs_whole: chunks so far
    other_block_ids: list[list[int]] = field(default_factory=list)  # groups 1.. (empty: one table for all)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled
    pooled: object = None  # engine/pooling.py: what the chunks so far contributed
    pooled_upto: int = 0  # the positions whose hidden states `pooled` holds

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def lora_id(self) -> int:
        return int(self.lora_request["lora_int_id"]) if self.lora_request else 0

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < n else []) + self.output_token_ids[max(start - n, 0) : end - n]


@dataclass
class Row:
    """One request's share of a step: compute tokens [start, start+len(token_ids))."""

    state: RequestState
    start: int
    token_ids: list[int]
    block_ids: list[int]
    sample: bool  # the chunk reaches the end of the known tokens
    num_draft: int = 0  # the last num_draft token_ids are draft tokens to verify (spec_decode.py)
    other_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def tables(self, num_groups: int) -> list[list[int]]:
        """One block table per KV cache group (a single table sent for all groups serves them all)."""
        return [self.block_ids, *self.other_block_ids] if self.other_block_ids else [self.block_ids] * num_groups


@dataclass
class StepPlan:
    finished: list[str]
    new_states: list[RequestState]
    # cached requests: (state, new block tables (one per group sent), new output tokens or None)
    updates: list[tuple[RequestState, list[list[int]], list[int] | None]]
    rows: list[Row]
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # rows taken out after planning (a failed disk-tier load): their computed tokens end here
    rewinds: list[tuple[RequestState, int]] = field(default_factory=list)
