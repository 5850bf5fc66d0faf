"""The test Driver with drafts: each step asks `drafts(req)` for a decode row's drafts, schedules
them (blocks for the k extra slots included) and rolls `computed` back by the rejected count, as
vLLM's scheduler does."""

from __future__ import annotations

from typing import Any, Callable

from tests.driver import Driver, Req


class SpecDriver(Driver):
    def __init__(self, execute: Callable[[dict], Any], block_size: int, num_blocks: int,
                 drafts: Callable[[Req], list[int]] | None = None, take: Callable[[], dict | None] | None = None):
        super().__init__(execute, block_size, num_blocks)
        self.drafts = drafts or (lambda r: [])
        self.take = take  # the worker's take_draft_token_ids, called after every step
        self.pending: dict[str, list[int]] = {}  # drafts to send in the next step (e.g. from take_draft_token_ids)
        self.tokens_per_step: list[list[int]] = []  # per step: tokens returned per decode row
        self.last: dict = {}

    def build(self, chunk: int, only: list[str] | None = None) -> dict:
        spec: dict[str, list[int]] = {}
        for r in self.reqs.values():
            if (only is None or r.rid in only) and r.sent and not r.resumed and r.computed == r.known - 1:
                d = self.pending.pop(r.rid, None)
                d = self.drafts(r) if d is None else d
                if d:
                    spec[r.rid] = list(d)
                    self._grow(r, r.known + len(d))
        so = super().build(chunk, only)
        for rid, d in spec.items():
            if rid in so["num_scheduled_tokens"]:
                so["num_scheduled_tokens"][rid] += len(d)
        so["total_num_scheduled_tokens"] = sum(so["num_scheduled_tokens"].values())
        so["scheduled_spec_decode_tokens"] = {rid: d for rid, d in spec.items() if rid in so["num_scheduled_tokens"]}
        self.pending.clear()
        return so

    def commit(self, so: dict, res: dict) -> None:
        spec = so["scheduled_spec_decode_tokens"]
        per_row = []
        for rid in so["num_scheduled_tokens"]:
            toks = res["sampled_token_ids"][res["req_id_to_index"][rid]]
            if rid in spec:
                per_row.append(len(toks))
        lp = res.get("logprobs")
        super().commit(so, {**res, "logprobs": None})
        for rid in so["num_scheduled_tokens"]:
            i = res["req_id_to_index"][rid]
            n = len(res["sampled_token_ids"][i])
            if lp and n:
                cu = lp["cu_num_generated_tokens"]
                first = cu[i] if cu is not None else i
                self.reqs[rid].logprobs += [row[0] for row in lp["logprobs"][first: first + n]]
        for rid, d in spec.items():
            toks = res["sampled_token_ids"][res["req_id_to_index"][rid]]
            self.reqs[rid].computed -= len(d) - (len(toks) - 1)
        self.tokens_per_step.append(per_row)
        self.last = res
        got = self.take() if self.take is not None else None
        if got is not None:
            self.pending = dict(zip(got["req_ids"], got["draft_token_ids"]))
