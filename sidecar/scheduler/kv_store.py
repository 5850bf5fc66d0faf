"""The reference scheduler's side of the worker's disk KV tier (docs/protocol.md, "Disk KV tier").

Plain Python, no MLX. On admission, after the in-memory prefix hit, it asks the worker
(`kv_store_lookup`) how many of the request's next full blocks the store holds, counts them as
computed and has the worker load them into the freshly allocated blocks (`kv_store_load`); every
block a step fills is saved (`kv_store_save`). A load the worker reports failed
(`kv_connector_output.invalid_block_ids`) rewinds the request to the first failed block, and its
output of that step is dropped, as vLLM's scheduler does: it is recomputed in the next steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Lookup = Callable[[list[bytes]], int]


class StoreTier:
    def __init__(self, lookup: Lookup, block_size: int):
        self.lookup, self.block_size = lookup, block_size
        self.loads: dict[str, tuple[int, int]] = {}  # req_id -> (first table index, count) for the next step
        self.hit_blocks = 0  # blocks served from the store

    def match(self, req: Any, hashes: list[bytes], local_blocks: int) -> int:
        """How many blocks after the local hit the store holds (never the block of the last known token)."""
        limit = (req.num_tokens - 1) // self.block_size
        want = hashes[local_blocks:limit]
        return self.lookup(want) if want else 0

    def admitted(self, req: Any, local_blocks: int, stored: int) -> None:
        if stored:
            self.loads[req.req_id] = (local_blocks, stored)

    def fields(self, reqs: dict[str, Any], num_scheduled: dict[str, int], spec: dict[str, list[int]]) -> dict:
        """The step's kv_store_load / kv_store_save maps."""
        bs, load, save = self.block_size, {}, {}
        for rid, (first, n) in self.loads.items():
            req = reqs[rid]
            load[rid] = {"block_hashes": req.block_hashes[first:first + n],
                         "block_ids": req.block_table[first:first + n]}
            self.hit_blocks += n
        self.loads = {}
        for rid, n in num_scheduled.items():
            req = reqs[rid]
            end = req.num_computed_tokens + n - len(spec.get(rid, ()))
            lo, hi = req.num_computed_tokens // bs, min(end, req.num_tokens) // bs
            if hi > lo:
                hashes = full_block_hashes(req, hi, bs)
                save[rid] = {"block_hashes": hashes[lo:hi], "block_ids": req.block_table[lo:hi]}
        return {"kv_store_load": load, "kv_store_save": save}

    @staticmethod
    def rewinds(reqs: dict[str, Any], num_scheduled: dict[str, int], output: dict, block_size: int) -> set[str]:
        """Requests whose load failed: their computed tokens end at the first failed block; their
        step output is skipped."""
        bad = set((output.get("kv_connector_output") or {}).get("invalid_block_ids") or ())
        out: set[str] = set()
        for rid in num_scheduled:
            req = reqs.get(rid)
            if req is None or not bad:
                continue
            for i, b in enumerate(req.block_table[: req.num_computed_tokens // block_size]):
                if b in bad:
                    req.num_computed_tokens = i * block_size
                    req.num_cached_blocks = min(req.num_cached_blocks, i)
                    out.add(rid)
                    break
        return out


def full_block_hashes(req: Any, n: int, block_size: int) -> list[bytes]:
    """The chained hashes of req's first n full blocks (blocks.py's, images included, grown lazily)."""
    from sidecar.scheduler.blocks import chain_hashes

    return chain_hashes(req.block_hashes, req.all_token_ids, n, block_size, getattr(req, "mm_spans", ()))
