"""A tiny, explicit scheduler for worker tests: every step's SchedulerOutput is built by hand rules
(fixed chunk size, blocks from a free list) so tests control prefix hits and preemption exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Req:
    rid: str
    prompt: list[int]
    sampling: dict
    blocks: list[int]
    computed: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: bool = False  # the worker has seen it
    resumed: bool = False
    new_blocks: list[int] = field(default_factory=list)
    pooling: dict | None = None  # a pooling request: sent instead of sampling params
    pooled: list | None = None  # its pooler_output, once returned

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.out)


class Driver:
    def __init__(self, execute: Callable[[dict], Any], block_size: int, num_blocks: int):
        self.execute, self.bs = execute, block_size
        self.free = list(range(num_blocks))
        self.reqs: dict[str, Req] = {}
        self.finished: list[str] = []
        self.preempted: list[str] = []

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"the test driver is out of blocks ({n} wanted, {len(self.free)} free)")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def add(self, rid: str, prompt: list[int], sampling: dict | None = None, *,
            blocks: list[int] | None = None, computed: int = 0, pooling: dict | None = None) -> Req:
        need = -(-len(prompt) // self.bs) + 4
        r = Req(rid, list(prompt), sampling or {"temperature": 0.0}, blocks if blocks is not None else self.alloc(need), computed)
        r.pooling = pooling
        self.reqs[rid] = r
        return r

    def _grow(self, r: Req, end: int) -> None:
        while len(r.blocks) * self.bs < end:
            b = self.alloc(1)
            r.blocks += b
            r.new_blocks += b

    def finish(self, rid: str) -> None:
        self.finished.append(rid)
        del self.reqs[rid]

    def preempt(self, rid: str) -> None:
        """Drop the request's blocks; it is resumed with fresh blocks and recomputed from 0."""
        r = self.reqs[rid]
        self.preempted.append(rid)
        r.blocks, r.computed, r.resumed, r.new_blocks = [], 0, True, []

    def build(self, chunk: int, only: list[str] | None = None) -> dict:
        new, cached = [], {"req_ids": [], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [],
                           "num_computed_tokens": [], "num_output_tokens": []}
        nst: dict[str, int] = {}
        for r in self.reqs.values():
            if only is not None and r.rid not in only:
                continue
            n = min(chunk, r.known - r.computed)
            if n <= 0:
                continue
            if r.resumed:
                r.blocks = self.alloc(-(-(r.computed + n) // self.bs))
                r.new_blocks = list(r.blocks)
            self._grow(r, r.computed + n)
            nst[r.rid] = n
            if not r.sent:
                new.append({"req_id": r.rid, "prompt_token_ids": r.prompt,
                            "sampling_params": None if r.pooling is not None else r.sampling, "pooling_params": r.pooling,
                            "block_ids": [list(r.blocks)], "num_computed_tokens": r.computed, "lora_request": None})
            else:
                cached["req_ids"].append(r.rid)
                if r.resumed:
                    cached["resumed_req_ids"].append(r.rid)
                cached["new_token_ids"].append([])
                cached["new_block_ids"].append([list(r.new_blocks)] if r.new_blocks or r.resumed else None)
                cached["num_computed_tokens"].append(r.computed)
                cached["num_output_tokens"].append(len(r.out))
        out = {"scheduled_new_reqs": new, "scheduled_cached_reqs": cached, "num_scheduled_tokens": nst,
               "total_num_scheduled_tokens": sum(nst.values()), "finished_req_ids": self.finished,
               "preempted_req_ids": self.preempted, "scheduled_spec_decode_tokens": {}, "num_common_prefix_blocks": [0]}
        return out

    def step(self, chunk: int = 16, only: list[str] | None = None, steps: int = 1) -> dict:
        """One call; `steps` > 1 asks for that many decode steps in it (num_decode_steps)."""
        so = self.build(chunk, only)
        if steps > 1:
            so["num_decode_steps"] = steps
        res = self.execute(so)
        res = res.to_wire() if hasattr(res, "to_wire") else res
        self.commit(so, res)
        return res

    def commit(self, so: dict, res: dict) -> None:
        self.finished, self.preempted = [], []
        for rid, n in so["num_scheduled_tokens"].items():
            r = self.reqs[rid]
            r.sent, r.resumed, r.new_blocks = True, False, []
            r.computed += n
            toks = res["sampled_token_ids"][res["req_id_to_index"][rid]]
            if res.get("pooler_output") and res["pooler_output"][res["req_id_to_index"][rid]] is not None:
                r.pooled = res["pooler_output"][res["req_id_to_index"][rid]]
            if toks:
                r.out += toks
                if so.get("num_decode_steps", 1) > 1:  # several decode steps: all but the last token computed
                    r.computed += len(toks) - 1
                lp = res.get("logprobs")
                if lp:
                    i = res["req_id_to_index"][rid]
                    at = lp["cu_num_generated_tokens"][i] if lp.get("cu_num_generated_tokens") else i
                    r.logprobs += [row[0] for row in lp["logprobs"][at : at + len(toks)]]

    def run(self, max_new: int, chunk: int = 16) -> dict[str, list[int]]:
        while any(len(r.out) < max_new for r in self.reqs.values()):
            self.step(chunk, only=[r.rid for r in self.reqs.values() if len(r.out) < max_new])
        return {rid: r.out[:max_new] for rid, r in self.reqs.items()}
