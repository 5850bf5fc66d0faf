"""The model runner: batch building, forward through the paged cache, sampling, output.

A step's rows are split into decode rows (one token) and prefill chunks of similar length, each
run as one padded batch, so a long chunk never pads 63 decodes (or a short chunk) up to its length.
Only the positions whose logits are needed (each row's last, plus prompt-logprob positions) go
through the LM head (selection.py). After a step's reply the likely next decode is queued
(overlap.py); outputs.py builds the output; multistep.py decodes on (`num_decode_steps`).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from sidecar.errors import ProtocolError, StateError
from sidecar.wire.protocol import ModelRunnerOutput, SchedulerOutput
from sidecar.engine import multistep, overlap, pooling, prefill_split
from sidecar.engine.grammar import GrammarMask, apply_grammar, decode_grammar
from sidecar.engine.lora import LoRAManager
from sidecar.engine.multimodal import Multimodal, refuse_images
from sidecar.kv.batch_caches import build_caches, read_bounded, read_limit, step_batches
from sidecar.kv.pool import KVPool, LayerSpec
from sidecar.kv.spec import STATE, ModelCaches
from sidecar.engine.planner import apply, plan_step
from sidecar.engine.state import RequestState, Row, StepPlan
from sidecar.engine.outputs import StepStats, build_output
from sidecar.engine.sampler import SampleResult, Sampler, SamplingRow, greedy_tokens, plain_greedy
from sidecar.engine.selection import forward_at, selected
from sidecar.engine.spec_decode import SpecCounters, Verified, verify


@dataclass
class _Pending:
    """A step whose sampling waits for `sample_tokens` (v2 two-phase step): its forward is queued."""

    rows: list[Row]
    logits: mx.array | None
    prompt_lp: dict
    restore: Callable[[], None]  # rolls the step's request state back
    started: float
    tier: Any = None  # the step's disk KV tier transfers (kv_tier.TierStep)


class ModelRunner:
    def __init__(self, model: nn.Module, specs: Sequence[LayerSpec], *, vocab_size: int,
                 eos_token_ids: Sequence[int], max_model_len: int, max_logprobs: int, seed: int = 0,
                 lora_dir: str | None = None, max_loras: int = 8, decode_ahead: bool = True,
                 caches: ModelCaches | None = None):
        self.model = model
        self.specs = list(specs)
        self.caches = caches or ModelCaches(self.specs, list(range(len(self.specs))))
        self.set_groups(self.caches.groups())
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.sampler = Sampler(vocab_size, eos_token_ids, seed)
        self.requests: dict[str, RequestState] = {}
        self.pool: KVPool | None = None
        self.last_stats = StepStats()
        self.lora = LoRAManager(model, lora_dir, max_loras)
        # The overlap writes a guessed step's K/V; a recurrent state it advanced could not be undone.
        self.decode_ahead = decode_ahead and not self.caches.has_state and not self.caches.scalar_offsets
        self.overlap = overlap.DecodeOverlap()
        self._pending: _Pending | None = None
        self.spec = SpecCounters()
        self.proposer: Any = None  # proposers.Proposer: drafts for the next step (take_draft_token_ids)
        # The hook for distributed groups: when set, each padded batch of `forward` runs inside this
        # context and is evaluated before the next is built (distributed/shard.py).
        self.batch_guard: Callable[[], AbstractContextManager] | None = None
        self.pooling: Any = None  # PoolingModel: what pooling requests may ask (None: generation only)
        self._pool_parts: dict[int, Any] = {}  # this step's hidden states of pooling rows (pooling.py)
        self._built: list[mx.array] | None = None  # this step's forwards' outputs, once one ran (see forward)
        self.kv_tier: Any = None  # kv_tier.KVTier: the disk KV tier (--kv-store-dir), else None
        self._tier_step: Any = None
        self.mm: Multimodal | None = None  # a vision-language model's images (engine/multimodal.py)

    ahead_hits = property(lambda self: self.overlap.hits)  # decode rows taken from the queued forward
    ahead_misses = property(lambda self: self.overlap.misses)  # rows it computed for nothing

    def set_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """KV cache groups as leaf indices, in the order requests send their block lists."""
        self.groups = [list(g) for g in groups]
        self.group_of = [0] * len(self.specs)
        for g, leaves in enumerate(self.groups):
            for leaf in leaves:
                self.group_of[leaf] = g
        state = frozenset(g for g, leaves in enumerate(self.groups) if self.specs[leaves[0]].kind == STATE)
        self.state_groups = state if self.caches.has_state else None

    def set_model(self, model: nn.Module) -> None:
        self.model = model
        self.lora.attach(model)
        if self.mm is not None:
            self.mm.model = model  # type: ignore[assignment]

    def drop_model(self) -> None:
        """Release every reference to the weights (sleep level 2); set_model brings them back."""
        self.overlap.clear()
        self.model = self.lora.model = None  # type: ignore[assignment]
        if self.mm is not None:
            self.mm.model = None  # type: ignore[assignment]

    def loras_in_use(self) -> set[int]:
        return {s.lora_id for s in self.requests.values()} - {0}

    # --- pool -------------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> None:
        self.free()
        self.pool = KVPool(self.specs, num_blocks)
        if self.proposer is not None:
            self.proposer.allocate(num_blocks)

    def free(self) -> None:
        self.overlap.clear()
        self._pending = self.pool = None
        self.requests.clear()
        if self.mm is not None:
            self.mm.clear()
        if self.proposer is not None:
            self.proposer.free()

    def read_limit(self) -> int:
        return read_limit(self.num_blocks * self.pool.block_size if self.pool else 0, self.max_model_len)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks if self.pool else 0

    def blocks_in_use(self) -> int:
        return len({b for s in self.requests.values() for t in [s.block_ids, *s.other_block_ids] for b in t})

    # --- the step -------------------------------------------------------------------------

    def decode(self, d: Any) -> SchedulerOutput:
        return SchedulerOutput.from_wire(d, vocab_size=self.vocab_size, max_logprobs=self.max_logprobs)

    def execute_model(self, out: SchedulerOutput, defer_sampling: bool = False) -> ModelRunnerOutput | None:
        """Run a step: plan -> batches -> forward -> sample -> output; the likely next decode is
        queued once the reply has left (overlap.py). With `defer_sampling` (v2) the forward is queued
        and None returned; `sample_tokens` then samples it (with a grammar bitmask) and returns the output."""
        assert self.pool is not None, "the cache must be initialised first"
        if self._pending is not None:
            raise StateError("execute_model: the previous step waits for sample_tokens; call sample_tokens first")
        self.overlap.flush()  # the last step's decode-ahead, if no server queued it after its reply
        t0 = time.perf_counter()
        multistep.check(out, defer_sampling)
        plan = plan_step(self.requests, out, num_blocks=self.pool.num_blocks, block_size=self.pool.block_size,
                         vocab_size=self.vocab_size, max_model_len=self.max_model_len, loras=self.lora.adapters.keys(),
                         state_groups=self.state_groups, num_groups=len(self.groups), pooling=self.pooling)
        mm_plan = self.mm.plan(out, self.requests, plan.rows) if self.mm else refuse_images(out, type(self.model).__module__)
        tier = self._tier_prepare(plan, out)
        restore = self._apply(plan)
        try:
            if tier is not None:
                self.overlap.clear()  # a queued decode must not run on blocks about to be loaded
                self.kv_tier.load(self.pool, tier)
            if self.mm is not None:
                restore = self.mm.apply(mm_plan, restore)
            logits, prompt_lp = self._logits(plan.rows)
            if defer_sampling:
                if logits is not None:
                    mx.async_eval(logits, *self.pool.arrays())
                self._pending = _Pending(plan.rows, logits, prompt_lp, restore, t0, tier)
                self.last_stats = StepStats()
                return None
            result = self._finish(plan.rows, logits, prompt_lp, live=True, more=out.num_decode_steps > 1)
            if out.num_decode_steps > 1:
                result = multistep.run(self, plan.rows, result, out.num_decode_steps)
        except BaseException:
            restore()
            raise
        self.last_stats.seconds = time.perf_counter() - t0
        if tier is not None:
            result.invalid_block_ids = tier.invalid
        return result

    def _tier_prepare(self, plan: StepPlan, out: SchedulerOutput) -> Any:
        """The disk KV tier's part of the step (kv_tier.py), validated before anything changes."""
        if self.kv_tier is None:
            if out.kv_store_load or out.kv_store_save:
                raise ProtocolError("this worker has no KV store (serve --kv-store-dir)",
                                    field="kv_store_load" if out.kv_store_load else "kv_store_save")
            self._tier_step = None
            return None
        self._tier_step = self.kv_tier.prepare(plan, out, self.pool)
        return self._tier_step

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        """Sample the step `execute_model(defer_sampling=True)` queued, applying vLLM's grammar
        bitmask (validated first: a rejected call leaves the step pending)."""
        p = self._pending
        if p is None:
            raise StateError("sample_tokens: no step is pending; call execute_model with defer_sampling first")
        grammar = decode_grammar(grammar_output, [r.state.req_id for r in p.rows], self.vocab_size)
        if grammar is not None and grammar.rows and any(r.num_draft for r in p.rows):
            raise ProtocolError("a grammar bitmask with speculative tokens in the step is not supported",
                                field="grammar_output")
        self._pending = None
        try:
            result = self._finish(p.rows, p.logits, p.prompt_lp, grammar, live=True)
        except BaseException:
            p.restore()
            raise
        self.last_stats.seconds = time.perf_counter() - p.started
        if p.tier is not None:
            result.invalid_block_ids = p.tier.invalid
        return result

    def decode_rows(self, rows: list[Row], more: bool = False) -> ModelRunnerOutput:
        """Another step of the call on `rows` (multistep.py), as live as its first; `more`: one follows."""
        return self._finish(rows, *self._logits(rows), live=True, more=more)

    def run_rows(self, rows: list[Row]) -> ModelRunnerOutput:
        """Forward and sample rows outside the scheduler's steps (the memory profile): nothing
        proposed, nothing queued, the queued forward left alone."""
        return self._finish(rows, *self._logits(rows, overlap=False))

    def _apply(self, plan: StepPlan) -> Callable[[], None]:
        """Apply the plan to the request state and block copies to the pool; returns what rolls
        the state back (an internal error leaves the worker as before the step)."""
        live = dict(self.requests)
        touched = [(s, s.block_ids, s.num_computed_tokens, s.output_token_ids, len(s.output_token_ids), s.first_token_at,
                    s.other_block_ids) for s in [row.state for row in plan.rows] + [s for s, _ in plan.rewinds]]

        def restore() -> None:
            self.overlap.clear()
            self._pending = None
            self.requests = live
            for s, blocks, computed, outputs, n, first, other in touched:
                del outputs[n:]
                s.block_ids, s.num_computed_tokens, s.output_token_ids, s.first_token_at = blocks, computed, outputs, first
                s.other_block_ids = other

        apply(self.requests, plan)
        if self.proposer is not None:
            self.proposer.forget(plan.finished)
        if plan.block_copies:  # before the forward; the queued decode may have read a destination
            self.overlap.clear()
            try:
                self.pool.copy_blocks(plan.block_copies)  # type: ignore[union-attr]
            except BaseException:
                restore()
                raise
        return restore

    def _logits(self, rows: list[Row], overlap: bool = True) -> tuple[mx.array | None, dict]:
        """The step's forward (lazy): each row's last logits and prompt-logprob spans. Decode rows
        the queued forward computed are taken from it; the rest run as padded batches."""
        self._pool_parts = {}
        if not rows:
            return None, {}
        last: list[mx.array | None] = [None] * len(rows)
        decode = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
        if overlap:
            decode, taken = self.overlap.take(self, rows, decode, last)
            if taken is not None:  # every row, in order
                self._built = [taken]
                return taken, {}
        self._built = [x for x in last if x is not None] or None  # (the queued forward may still read the pool)
        prefill = [i for i, r in enumerate(rows) if len(r.token_ids) > 1]
        prompt_lp: dict[int, tuple[mx.array, list[int]]] = {}
        rows, tails = prefill_split.forward_heads(self, rows)  # mlx-lm's: a sampling chunk's head, then its last token
        decode, prefill = decode + tails, [i for i in prefill if i not in set(tails)]
        limit = self.read_limit()
        groups = [g for group in step_batches(rows, decode, prefill, self.caches) for g in read_bounded(rows, group, limit) if g]
        stores: list = []  # recurrent states are written back once every batch of the step is built
        whole = len(groups) == 1 and groups[0] == list(range(len(last)))  # one batch: its array, no slice per row
        runs = [self.forward([rows[i] for i in g], g, None if whole else last, prompt_lp, stores=stores) for g in groups]
        for store in stores:
            store()
        if whole:
            return runs[0], prompt_lp
        return (last[0] if len(last) == 1 else mx.concatenate(last, axis=0)), prompt_lp  # type: ignore[arg-type]

    def _finish(self, rows: list[Row], logits: mx.array | None, prompt_lp: dict, grammar: GrammarMask | None = None,
                live: bool = False, more: bool = False) -> ModelRunnerOutput:
        """Sample the step's logits and build its output; a `live` step (the scheduler's) also
        hands its tokens to the proposer and queues the likely next decode: after the reply, or,
        when the call decodes on (`more`), built before the sync and run right after it."""
        if logits is None:
            self.last_stats = StepStats()
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        logits = apply_grammar(logits, grammar)
        verified: Verified | None = None
        pool = self.pool.arrays()  # type: ignore[union-attr]
        if any(r.num_draft for r in rows):
            probs = self.proposer.draft_probs(rows) if self.proposer is not None else None
            verified = verify(self.sampler, logits, rows, probs)
            res = SampleResult([t[0] if t else 0 for t in verified.token_ids], None, None, None, verified.num_nans)
        elif grammar is None and all(plain_greedy(r.state.sampling_params, len(r.state.output_token_ids))
                                     for r in rows):  # argmax is the whole sampler
            tokens, nans = greedy_tokens(logits), mx.isnan(logits).sum(axis=-1)
            if more and self.decode_ahead and (self.proposer, self._tier_step, self.batch_guard) == (None,) * 3:
                self._built = None  # (nothing to settle: it runs after the sync, overlap.py)
                self.overlap.guarded(self.overlap.prepare, self, rows, tokens, [r.end for r in rows], (), 1)
            mx.eval(tokens, nans, pool)  # the step's one sync
            res, pool = SampleResult(tokens.tolist(), None, None, None, nans.tolist()), []
        else:
            res = self.sampler.sample(logits, [SamplingRow(r.state.sampling_params, r.state.prompt_token_ids,
                                                           r.state.output_token_ids) for r in rows])
        if pool:  # computed with the logits already; evaluated, no task of the step holds a pool buffer
            mx.eval(pool)
        self._built = None
        if live and self._tier_step is not None:  # before the next decode is queued on the pool
            self.kv_tier.save(self.pool, self._tier_step)
            self._tier_step = None
        if live:
            drafted = self._propose(rows, res, verified)
            # A row that verified drafts decodes its last token next, after the accepted ones.
            last_tok = res.token_ids if verified is None else [t[-1] if t else 0 for t in verified.token_ids]
            at = [r.end - r.num_draft + (len(t) - 1 if r.num_draft else 0)
                  for r, t in zip(rows, verified.token_ids if verified else [[]] * len(rows))]
            if self.overlap.prepared is not None:  # the call decodes on: no reply in between
                self.overlap.dispatch(self, last_tok)
            elif self.decode_ahead:  # queued once the reply has left (overlap.py)
                self.overlap.defer(self, rows, last_tok, at, drafted)
        out, self.last_stats = build_output(rows, res, verified, prompt_lp,
                                            pooling.finish(rows, self._pool_parts, self.model))
        if verified is not None:
            self.spec = SpecCounters(self.spec.draft_tokens + verified.num_draft,
                                     self.spec.accepted_tokens + verified.num_accepted, self.spec.steps_with_drafts + 1)
        return out

    def forward(self, rows: list[Row], where: list[int], last: list | None, prompt_lp: dict,
                stores: list | None = None, ids: mx.array | None = None) -> mx.array:
        """One padded batch of `rows` through the paged cache, lazy: fills `last[where[b]]` (None: no
        slice per row) with row b's logits [1 + num_draft, V] (its last position, and its drafts')
        and `prompt_lp[where[b]]` with its prompt-logprob span (logits, targets). Recurrent states
        are stored now, or, with `stores`, by the callable appended to it (once every batch of the
        step is built). `ids`: the rows' token ids [B, L] when not their `token_ids` (lazy: a
        step's sampled tokens). Returns the rows' last logits (and drafts') as one array."""
        self._settle()
        if self.batch_guard is None:
            return self._batch(rows, where, last, prompt_lp, stores, ids)
        with self.batch_guard():
            out = self._batch(rows, where, last, prompt_lp, stores, ids)
            mx.eval(out)
        return out

    def _settle(self) -> None:
        """Before a step's second forward, evaluate the ones before it: MLX writes a pool in place
        only when nothing else reads its buffer, and their attention reads (views of the pool)
        would still be pending, so every layer's whole pool would be copied, a cost that grows with
        the pool, not the step."""
        if self._built is not None:
            mx.eval(self._built, self.pool.arrays())  # type: ignore[union-attr]
        self._built = []

    def _batch(self, rows: list[Row], where: list[int], last: list | None, prompt_lp: dict,
               stores: list | None, ids: mx.array | None) -> mx.array:
        pool = self.pool
        assert pool is not None
        lengths = [len(r.token_ids) for r in rows]
        L = max(lengths)
        sel = selected(rows, lengths)
        keep, pool_spans = pooling.positions(rows, lengths, L)
        caches, store_states = build_caches(self.caches, pool, self.group_of, rows, lengths)
        if ids is None:  # [B, L] token ids, each row padded with 0s
            flat: list[int] = []
            for r, n in zip(rows, lengths):
                flat += r.token_ids
                flat += [0] * (L - n)
            ids = mx.array(flat, dtype=mx.int32).reshape(len(rows), L)
        if self.mm is not None:
            self.mm.bind(rows, ids)
        if self.lora.adapters:
            self.lora.set_rows([r.state.lora_id for r in rows])
        try:
            logits, hidden = forward_at(self.model, ids, caches, sel.index,
                                        mx.array(keep, dtype=mx.int32) if keep else None)
            read = sel.spans or any(r.sample for r in rows)  # (a head's logits are never read: left uncomputed)
            self._built += [x for x in (logits if read else None, hidden) if x is not None]
            pooling.collect(hidden, pool_spans, where, self._pool_parts)
            if stores is not None:
                stores.append(store_states)
            else:
                store_states()
        finally:
            self.lora.rows.groups = []
        # Kept in the model's dtype: greedy ranks them as mlx-lm does (sampler.greedy_tokens); the
        # sampler and logprobs work in float32 from them.
        mine = [logits[a : a + 1 + r.num_draft] for a, r in zip(sel.last_at, rows)] if last is not None or sel.spans else []
        for w, x in zip(where, mine if last is not None else ()):
            last[w] = x
        for b, first, count, targets in sel.spans:
            prompt_lp[where[b]] = (logits[first : first + count], targets)
        return logits if not sel.spans else mx.concatenate(mine, axis=0)

    def _propose(self, rows: list[Row], res: SampleResult, verified: Verified | None) -> set[str]:
        """Hand this step's tokens to the proposer (drafts for the next step); returns the ids it drafted for."""
        if self.proposer is None:
            return set()
        toks = [[int(t)] if r.sample else [] for r, t in zip(rows, res.token_ids)] if verified is None else verified.token_ids
        return self.proposer.propose(self, rows, toks)
