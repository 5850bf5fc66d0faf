"""Decode ahead across a block boundary: the ahead forward of a row whose next token opens a new block.

The scheduler allocates that block with the step that decodes the token, so the ahead forward
(ahead.py) cannot know its id. Without this, one decode step in `block_size` gets no forward
queued ahead and its whole round trip leaves the device idle. Instead, the row's ahead forward
reads and writes its blocks followed by the pool's scratch block (kv_cache.py: a block id past
every request's, of which only slot 0 exists): the new token's K/V land in the scratch slot and
the token attends over it. When the next step brings exactly that decode (same request, position,
token and first blocks) plus the block B it allocated, the scratch slot is copied into B's slot 0
in every layer, queued in that step before anything can read B (the next forward is built after
it, a prefix hit on B only once B is full), and the ahead logits are used. A miss leaves nothing
behind: no request can address the scratch slot, and the next crossing overwrites it.

Served for models whose every layer is plain full attention (one KV cache group), quantised K/V
included: the scratch slot is a slot like any other. Sliding windows, chunked attention, MLA and
recurrent state keep the old rule (no ahead forward at a boundary). One row crosses per ahead
forward (one scratch slot); a single stream is the case that needs it (a batch's steps hide the
round trip behind more work). `enabled = False` (or MLX_SIDECAR_BOUNDARY_AHEAD=0 in the server's
environment) turns it off: internal, for the tests and the bench that compare against it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from sidecar.runner.attention import is_run
from sidecar.runner.kv_cache import KVPool, _parts
from sidecar.runner.kv_spec import ATTENTION
from sidecar.runner.state import Row

if TYPE_CHECKING:
    from sidecar.runner.model_runner import ModelRunner

enabled = os.environ.get("MLX_SIDECAR_BOUNDARY_AHEAD", "1") != "0"

# A lone row whose blocks are one run is read in place; crossing makes that read a gather of its
# whole K/V, measured on the CPU backend at +0.3 ms for 4 MiB, +0.65 ms for 8-12 MiB, +1.2 ms for
# 16 MiB (builtin:longctx, builtin:small). Past this it costs about the ~1 ms round trip it hides
# (one crossing in block_size steps either way), and the old rule is kept.
MAX_GATHER_BYTES = 8 << 20


def supported(runner: ModelRunner) -> bool:
    return enabled and len(runner.groups) == 1 and all(
        s.kind == ATTENTION and not s.sliding_window and not s.attention_chunk_size for s in runner.specs)


def admit(runner: ModelRunner, rows: list[Row], idx: list[int], at: list[int]) -> tuple[list[int], int | None]:
    """Of the ahead candidates `idx` (next position at most one past their blocks), those inside
    their blocks, plus at most one whose next position opens a new block: (kept, that one or None)."""
    bs = runner.pool.block_size  # type: ignore[union-attr]
    inside = [i for i in idx if at[i] < len(rows[i].block_ids) * bs]
    if len(inside) == len(idx) or not supported(runner):
        return inside, None
    cross = next(i for i in idx if at[i] >= len(rows[i].block_ids) * bs)
    if not inside and is_run(np.asarray(rows[cross].block_ids)) and at[cross] * sum(
            sp.page_size_bytes for sp in runner.specs) > MAX_GATHER_BYTES * bs:
        return inside, None
    return sorted([*inside, cross]), cross


def table(pool: KVPool, row: Row) -> list[int]:
    """The crossing row's blocks for its ahead forward: its own, then the scratch block."""
    return [*row.block_ids, pool.scratch]


@dataclass
class Crossing:
    """The row an ahead forward ran into the scratch block, and its token's K/V read back from the
    scratch slot (one [1, H, 1, n] per pool array, computed with the forward)."""

    req_id: str
    kv: list[mx.array]


def save(pool: KVPool, req_id: str) -> Crossing:
    """After the crossing forward is built: its scratch slot, as arrays of its own (so landing them
    is an in-place slice update of each pool array, as a forward's write is; an update from the
    pool itself, a view or a gather of it, copies the whole pool)."""
    src = mx.array([pool.scratch * pool.block_size], dtype=mx.int32)
    return Crossing(req_id, [a[:, :, src] for leaf in pool.keys + pool.values for a in _parts(leaf)])


def land(pool: KVPool, row: Row, crossing: Crossing) -> bool:
    """The next step decodes the crossing row's token: write its K/V into slot 0 of the block the
    step allocated for it, in every layer (lazy, ahead of everything this step and later builds).
    False when the step gives the row no block there (then it is a miss)."""
    n = row.start // pool.block_size
    if row.start % pool.block_size or len(row.block_ids) <= n:
        return False
    dst = row.block_ids[n] * pool.block_size
    mx.eval(crossing.kv)  # (computed by now, normally): no pool array then has a reader left
    kv = iter(crossing.kv)
    landed = [a for leaf in pool.keys + pool.values for a in _parts(leaf)]
    for a in landed:
        a[:, :, dst : dst + 1] = next(kv)
    mx.eval(landed)  # (no landing left queued when a forward dispatched before the reply writes)
    return True
