"""Decode overlap: the likely next decode forward, queued as a step returns (mlx-lm's generate loop).

The runner calls it at two points:

- `defer`, once a step's tokens are known: every row that sampled most likely decodes its new
  token next, with the same block table. That forward is built and handed to `mx.async_eval`
  (`flush`) once the step's reply has left (the server's MLX thread flushes right after handing the
  reply over), so it computes while the reply travels and the scheduler plans, and the reply does
  not wait for the forward's graph to be built and dispatched. Anything that runs before the next
  step flushes it first; anything that changes the blocks under it clears it.
- `prepare` then `dispatch`, inside a call that decodes several steps (multistep.py), where no
  reply comes between two steps: the next decode's graph is built on the step's sampled tokens
  while they are still lazy, so it is built while the step computes (as mlx-lm's generate loop
  builds its next step), and runs as soon as the step's sync returns.
- `take`, when the next step arrives: its decode rows that match the queued forward exactly (same
  request, position, token and blocks) use its logits; the runner computes the rest.

Why a miss is harmless: the queued forward's only side effect is the K/V of that token at that
position, in a slot of the request's own last, partial block, which the scheduler assigns to
exactly this token and which no other request reads before writing it itself (a partial block is
never prefix-cached). Recurrent state it advanced could not be undone: the runner keeps the
overlap off for such models.

Why it runs only once the step is computed: a task of the step still holding a pool buffer would
keep MLX from donating that buffer to the forward's K/V write, which would then copy the layer's
whole pool. Building the graph earlier is safe: MLX decides donation when a graph runs.

A row whose next token opens a new block (it "crosses"): the scheduler allocates that block with
the step that decodes the token, so its id is not known yet. The row's forward reads and writes
its blocks followed by the pool's scratch block (kv/pool.py: a block id past every request's, of
which only slot 0 exists). When the next step brings exactly that decode plus the block B it
allocated, the scratch slot is copied into B's slot 0 in every layer before anything can read B
(a prefix hit on B only comes once B is full), and the logits are used. A miss leaves nothing
behind: no request can address the scratch slot, and the next crossing overwrites it. One row
crosses per queued forward (one scratch slot), on models whose every layer is plain full
attention (one KV cache group, quantised K/V included).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from sidecar.kv.pool import KVPool, _parts
from sidecar.kv.spec import ATTENTION
from sidecar.engine.state import Row

# Internal, for the tests and the bench that compare against it: MLX_SIDECAR_BOUNDARY_AHEAD=0
# (or `crossing = False`) queues no forward for a row whose next token opens a new block.
crossing = os.environ.get("MLX_SIDECAR_BOUNDARY_AHEAD", "1") != "0"
log = logging.getLogger(__name__)


def tables(row: Row) -> tuple[list[int], ...]:
    return (row.block_ids, *row.other_block_ids)


def same_blocks(row: Row, queued: tuple[list[int], ...], n: int) -> bool:
    """The row's first n blocks in every group are those of the `queued` tables (which the queued
    forward read and wrote). A step replaces a table, never edits it (planner.apply): the same list
    is the same blocks, so a decode step compares nothing per block (a new list: the first n)."""
    now = tables(row)
    return len(now) == len(queued) and all(a is b or a[:n] == b[:n] for a, b in zip(now, queued))


def crossing_supported(runner: Any) -> bool:
    return crossing and len(runner.groups) == 1 and all(
        s.kind == ATTENTION and not s.sliding_window and not s.attention_chunk_size for s in runner.specs)


@dataclass
class Queued:
    """The queued forward: req_id -> (position, token, block tables, its row in `logits`)."""

    rows: dict[str, tuple[int, int, tuple, int]]
    logits: mx.array  # [rows, vocab]
    crossing_id: str | None = None  # the row that wrote into the scratch slot
    crossing_kv: Sequence[mx.array] = ()  # its K/V, read back from the scratch slot (one per pool array)


class DecodeOverlap:
    def __init__(self) -> None:
        self.queued: Queued | None = None
        self.deferred: tuple | None = None  # `queue`'s arguments, until `flush`
        self.prepared: tuple | None = None  # a forward built by `prepare`, until `dispatch`
        self.hits = self.misses = 0  # decode rows taken from a queued forward / queued for nothing

    def clear(self) -> None:
        self.queued = self.deferred = self.prepared = None

    def defer(self, *args: Any) -> None:
        """`queue(*args)` at the next `flush`."""
        self.queued, self.deferred = None, args

    def flush(self) -> None:
        args, self.deferred = self.deferred, None
        if args is not None:
            self.guarded(self.queue, *args)

    def guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a guess that failed: the next step computes its rows itself
            self.clear()
            log.warning("the decode-ahead forward failed; the next step computes its rows", exc_info=True)

    def queue(self, runner: Any, rows: Sequence[Row], tokens: Sequence[int], at: Sequence[int],
              skip: set[str] | frozenset[str] = frozenset()) -> None:
        """After a step whose `tokens` are known (and computed, with every pool write of the step):
        queue the decode of each sampled row's token at `at` (its next position: r.end, or past the
        drafts it accepted), unless it got new drafts (`skip`: its next step verifies them)."""
        self.prepare(runner, rows, tokens, at, skip)
        self.dispatch(runner, tokens)

    def prepare(self, runner: Any, rows: Sequence[Row], tokens: Sequence[int] | mx.array, at: Sequence[int],
                skip: set[str] | frozenset[str] = frozenset(), sampled: int = 0) -> None:
        """Build that forward's graph, not yet run. `tokens` may be the step's sampled ids still
        lazy, not yet among the rows' outputs (`sampled` = 1): the graph is then built while the
        step computes, as mlx-lm builds its next step's, and `dispatch` runs it once the step is done."""
        self.queued = self.prepared = None
        pool: KVPool = runner.pool
        bs = pool.block_size
        idx = [i for i, r in enumerate(rows) if r.sample and r.state.req_id not in skip
               and at[i] <= len(r.block_ids) * bs and at[i] < runner.max_model_len
               and len(r.state.output_token_ids) + sampled + at[i] - r.end + r.num_draft + 1
               < (r.state.sampling_params.max_tokens or 1 << 62)]
        inside = [i for i in idx if at[i] < len(rows[i].block_ids) * bs]
        cross = next((i for i in idx if i not in inside), None)
        cross = cross if cross is not None and crossing_supported(runner) else None
        idx = sorted(inside + ([] if cross is None else [cross]))
        if not idx or len(idx) * (max(at[i] for i in idx) + 1) > runner.read_limit():
            return  # (one batch only: past the read limit the next step splits its rows itself)
        past = runner.caches.rows_apart_past
        if past is not None and len(idx) > 1 and max(at[i] for i in idx) >= past:
            return  # (those rows run one at a time: step_batches)
        lazy = isinstance(tokens, mx.array)
        ids = (tokens if len(idx) == len(rows) else tokens[mx.array(idx)]).reshape(-1, 1) if lazy else None
        nxt = [Row(rows[i].state, at[i], [0 if lazy else int(tokens[i])], [*rows[i].block_ids, pool.scratch]
                   if i == cross else rows[i].block_ids, True, other_block_ids=rows[i].other_block_ids) for i in idx]
        logits = runner.forward(nxt, list(range(len(nxt))), None, {}, ids=ids)
        kv: list[mx.array] = []
        if cross is not None:  # arrays of their own: landing them is an in-place slice update
            src = mx.array([pool.scratch * bs], dtype=mx.int32)
            kv = [a[:, :, src] for leaf in pool.keys + pool.values for a in _parts(leaf)]
        self.prepared = (rows, at, idx, cross, logits, kv)

    def dispatch(self, runner: Any, tokens: Sequence[int]) -> None:
        """Run the prepared forward, once the step it follows is computed and nothing holds that
        step's pool arrays (else MLX copies each layer's whole pool instead of writing it in place)."""
        p, self.prepared = self.prepared, None
        if p is None:
            return
        rows, at, idx, cross, logits, kv = p
        mx.async_eval(logits, *runner.pool.arrays(), *kv)
        self.queued = Queued({rows[i].state.req_id: (at[i], int(tokens[i]), tables(rows[i]), j)
                              for j, i in enumerate(idx)}, logits,
                             None if cross is None else rows[cross].state.req_id, kv)

    def take(self, runner: Any, rows: Sequence[Row], decode: list[int], last: list) -> tuple[list[int], mx.array | None]:
        """Fill `last` for the decode rows the queued forward computed; returns the rest, and the
        queued logits when they are exactly all of `last` in order (one array: `last` is then left
        unfilled, no slice per row)."""
        self.flush()
        q, self.queued = self.queued, None
        if q is None:
            return decode, None
        bs = runner.pool.block_size
        rest, hit = [], []  # hit: (row, its row in the queued logits)
        for i in decode:
            r = rows[i]
            got = q.rows.get(r.state.req_id)
            crossed = r.state.req_id == q.crossing_id  # matches on its first blocks; lands in its new one
            if got is not None and got[0] == r.start and got[1] == r.token_ids[0] \
                    and same_blocks(r, got[2], r.start // bs + (not crossed)) \
                    and (not crossed or _land(runner.pool, r, q.crossing_kv)):
                hit.append((i, got[3]))
            else:
                rest.append(i)
        self.hits += len(hit)
        self.misses += len(q.rows) - len(hit)
        if len(hit) == len(last) == len(q.rows) and all(i == j for i, j in hit):
            return rest, q.logits
        for i, j in hit:
            last[i] = q.logits[j : j + 1]
        return rest, None


def _land(pool: KVPool, row: Row, kv: Sequence[mx.array]) -> bool:
    """Write the crossing token's K/V into slot 0 of the block the step allocated for it, in every
    layer; False when the step gives the row no block there (a miss)."""
    n = row.start // pool.block_size
    if row.start % pool.block_size or len(row.block_ids) <= n:
        return False
    dst = row.block_ids[n] * pool.block_size
    mx.eval(kv)  # (computed by now, normally): no pool array then has a reader left
    landed = [a for leaf in pool.keys + pool.values for a in _parts(leaf)]
    for a, x in zip(landed, kv):
        a[:, :, dst : dst + 1] = x
    mx.eval(landed)
    return True
