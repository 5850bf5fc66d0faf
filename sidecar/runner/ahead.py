"""Decode ahead: the likely next decode forward, queued right after a step returns.

Every row that sampled decodes its new token with the same block table. It runs while the
response travels and the scheduler plans, and is used row by row where the next step matches
exactly. How far it overlaps is bounded by MLX itself: `async_eval` returns only once at most ~10
tasks (~100 ops on the CPU backend) are left queued, so one forward queued ahead is as deep as the
overlap goes (queueing a second would hold the step until the first is nearly computed). That wait
would hold the step's reply too; where the server runs `ModelRunner.after_reply` on the MLX thread
after each reply (server/rpc.py), the forward is built in the step and dispatched there instead,
so the reply leaves as soon as the step's own tokens are known and the next forward computes
while it travels. Without that caller it is dispatched as the step returns, never before the
step's tokens: a task of the step still holding a pool buffer would keep MLX from donating it to
the forward's K/V write, which would then copy the layer's whole pool.

On the CPU backend, after a step long enough that the round trip is a small share of it (a model
of real size; `before_reply`), the forward is dispatched before the reply even with the hook, as
mlx-lm's generate loop queues the next token's forward before reading the current one: while the
step's LM head computes (`dispatch_early`: once the input of its final norm is computed, every
read of the pool by the step is too), else as the step returns. async_eval holds the caller until
the forward is nearly queued, so the reply leaves about half a step later, but the device no
longer idles while the reply is written and travels and the scheduler plans, nor while MLX
builds the next forward's tape. Shorter steps (a tiny model) keep the dispatch after the reply,
where it overlaps the round trip. On Metal async_eval returns at once, and the after-reply
dispatch leaves little to hide.

After a step shorter than DEFER_MAX_SECONDS (less than a round trip: its forward computes within
the round trip wherever it starts), the hook builds the forward too (`start(defer=True)`): the
reply leaves without waiting for the graph to be built, and the next forward is as early as the
device could use it anyway. A next step that comes before the hook ran computes its rows itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from sidecar.runner import boundary
from sidecar.runner.state import Row

if TYPE_CHECKING:
    from sidecar.runner.model_runner import ModelRunner


@dataclass
class _Ahead:
    """A decode forward for the step the scheduler will most likely send next, used row by row
    where the next step matches exactly (same request, position, token and blocks). Its only side
    effect is the K/V of that token at that position, in a slot of the request's own last, partial
    block, which the scheduler assigns to exactly this token, and which no other request reads
    before writing it itself (a partial block is never prefix-cached), so a miss is harmless."""

    rows: dict[str, tuple[int, int, tuple[int, ...], int]]  # req_id -> (position, token, blocks, index)
    logits: mx.array | None  # [rows, vocab]; None until `build` runs (after the reply)
    crossing: boundary.Crossing | None = None  # the row that wrote into the scratch block
    build: Callable[[], tuple[mx.array, boundary.Crossing | None]] | None = None

    def built(self) -> None:
        """Build the forward a short step left for after its reply (`start(defer=True)`)."""
        if self.build is not None:
            build, self.build = self.build, None
            self.logits, self.crossing = build()


def blocks_key(row: Row, n: int) -> tuple:
    """Every group's first n blocks: an ahead forward wrote to exactly these."""
    return tuple(tuple(t[:n]) for t in [row.block_ids, *row.other_block_ids])


def plain_greedy(row: Row) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs: argmax is the whole sampler."""
    p = row.state.sampling_params
    return (p.greedy and not p.has_penalties and not p.logit_bias and not p.allowed_token_ids
            and not p.bad_words_token_ids and p.logprobs is None and len(row.state.output_token_ids) >= p.min_tokens)


# (rows, logits, crossing, or none of these yet but the function that builds them)
Started = tuple[list[int], mx.array | None, boundary.Crossing | None,
                Callable[[], tuple[mx.array, boundary.Crossing | None]] | None]


def start(runner: ModelRunner, rows: list[Row], tokens: mx.array, skip: set[str] | frozenset[str] = frozenset(),
          at: list[int] | None = None, defer: bool = False) -> Started | None:
    """Queue the forward of the likely next decode step on this step's tokens [rows], which may
    still be lazy: then it follows the sampling without a gap, as mlx-lm's generate loop does.
    Returns the rows it covers, its logits and crossing, or with `defer` none of these yet but
    the function that builds them (after the reply). `at`: each row's next position (r.end,
    unless it verified drafts: the position after its accepted ones, spec_decode.py)."""
    bs = runner.pool.block_size  # type: ignore[union-attr]
    at = at or [r.end for r in rows]
    # Rows that got new drafts (their next step is not a plain decode) are left out.
    idx = [i for i, r in enumerate(rows) if r.sample and r.state.req_id not in skip
           and at[i] <= len(r.block_ids) * bs and at[i] < runner.max_model_len
           and len(r.state.output_token_ids) + at[i] - r.end + r.num_draft + 1
           < (r.state.sampling_params.max_tokens or 1 << 62)]
    idx, cross = boundary.admit(runner, rows, idx, at)  # a row opening a new block: the scratch block
    if not idx or len(idx) * (max(at[i] for i in idx) + 1) > runner.read_limit():
        return None  # (one batch only: past the read limit the next step splits its rows itself)
    nxt = [Row(rows[i].state, at[i], [0], boundary.table(runner.pool, rows[i]) if i == cross else rows[i].block_ids,  # type: ignore[arg-type]
               True, other_block_ids=rows[i].other_block_ids) for i in idx]
    nxt_tokens = tokens[:, None] if len(idx) == len(rows) else tokens[mx.array(idx, dtype=mx.int32)][:, None]
    cross_id = None if cross is None else rows[cross].state.req_id

    def build() -> tuple[mx.array, boundary.Crossing | None]:
        last: list[mx.array | None] = [None] * len(nxt)
        runner._forward(nxt, list(range(len(nxt))), last, {}, tokens=nxt_tokens)
        logits = last[0] if len(last) == 1 else mx.concatenate(last, axis=0)  # type: ignore[arg-type]
        crossing = None if cross_id is None else boundary.save(runner.pool, cross_id)  # type: ignore[arg-type]
        runner._dispatch = [logits, *runner.pool.arrays(), *(crossing.kv if crossing else [])]  # type: ignore[union-attr]
        return logits, crossing

    if defer:
        return idx, None, None, build
    logits, crossing = build()  # dispatched once the step's tokens are known (ModelRunner.after_reply)
    return idx, logits, crossing, None


# After a step at least this long (its own time), the ahead forward is dispatched before the reply.
EARLY_MIN_SECONDS = 0.002


def before_reply(runner: ModelRunner) -> bool:
    """Whether the forward queued ahead is dispatched as the step returns, before its reply,
    though the server's after-reply hook runs: on the CPU backend, after a long step."""
    return runner.step_seconds >= EARLY_MIN_SECONDS and mx.default_device() == mx.cpu


# After a step shorter than this (its own time), the after-reply hook also builds the forward.
DEFER_MAX_SECONDS = 0.001


def defer_build(runner: ModelRunner) -> bool:
    """Whether the forward queued ahead is built after the reply too (the hook runs, the step is short)."""
    return (runner.dispatch_after_reply and 0.0 < runner.step_seconds < DEFER_MAX_SECONDS
            and not before_reply(runner))


def dispatch_early(runner: ModelRunner, hidden: mx.array | None) -> None:
    """After a long step, dispatch the forward `start` built while the step's LM head computes.
    `hidden`: the input of the final norm of the step's last forward (selection.py); once it is
    computed, so is every op before it on the stream, each read of the pool included, and MLX can
    donate every pool buffer to the next forward's writes."""
    if hidden is not None and runner._dispatch and before_reply(runner):
        mx.eval(hidden)
        runner._dispatch_unless_hooked(True)


def record(rows: list[Row], started: Started, token_ids: list[int], block_size: int,
           at: list[int] | None = None) -> _Ahead:
    """The queued forward, keyed by what the next step must match to use it (`at`: as for start)."""
    idx, logits, crossing, build = started
    at = at or [r.end for r in rows]
    return _Ahead({rows[i].state.req_id: (at[i], int(token_ids[i]), blocks_key(rows[i], at[i] // block_size + 1), j)
                   for j, i in enumerate(idx)}, logits, crossing, build)


def take(runner: ModelRunner, ahead: _Ahead | None, rows: list[Row], decode: list[int], last: list) -> list[int]:
    """Fill `last` for the decode rows the ahead forward computed; returns the rest."""
    if ahead is None or ahead.logits is None:
        return decode
    bs = runner.pool.block_size  # type: ignore[union-attr]
    rest = []
    for i in decode:
        r = rows[i]
        got = ahead.rows.get(r.state.req_id)
        # The crossing row matches on its first blocks; its new block then gets the scratch slot.
        cross = ahead.crossing is not None and r.state.req_id == ahead.crossing.req_id
        if got is not None and got[:3] == (r.start, r.token_ids[0], blocks_key(r, r.start // bs + (not cross))) and (
                not cross or boundary.land(runner.pool, r, ahead.crossing)):  # type: ignore[arg-type]
            last[i] = ahead.logits[got[3] : got[3] + 1]
        else:
            rest.append(i)
    runner.ahead_hits += len(decode) - len(rest)
    runner.ahead_misses += len(ahead.rows) - (len(decode) - len(rest))
    return rest
