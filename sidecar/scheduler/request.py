"""A request as the reference scheduler tracks it, and the events a step reports. Plain data."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from sidecar.scheduler import images


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity equality: requests live in lists that are searched and removed from
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: dict  # wire map with vLLM field names (temperature, top_p, seed, logprobs, ...)
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # over prompt + output tokens; reset to 0 by preemption
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the eos/stop token that finished it
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    sent: bool = False  # the worker has seen it: it is a "new" request exactly once
    # Block manager state (blocks.SeqLike).
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next step
    # A pooling request (wire pooling_params, vLLM names): prefilled, never sampled; finished by
    # the step that returns its pooler_output, kept in `pooled`. Use max_tokens=1.
    pooling_params: dict | None = None
    pooled: list | None = None
    mm_features: list[dict] = field(default_factory=list)  # wire items (images.py), sent with the new request

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.req_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"request {self.req_id!r}: min_tokens must be in [0, max_tokens]")

    @property
    def mm_spans(self) -> list[tuple[int, int, str]]:
        """Its images' placeholders and identifiers, which its block hashes take (blocks.py)."""
        return images.spans(self.mm_features)

    @property
    def min_tokens(self) -> int:
        return int(self.sampling_params.get("min_tokens") or 0)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def wire_sampling_params(self) -> dict:
        # vLLM's SamplingParams carries these too; the worker needs them for min_tokens masking.
        return {**self.sampling_params, "max_tokens": self.max_tokens,
                "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos}


@dataclass
class Event:
    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    pooled: list | None = None  # a pooling request's result
