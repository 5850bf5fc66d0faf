"""Reference scheduler with vLLM v1's policy, driving a worker over the execute_model wire protocol.

Plain Python, no MLX. A step is `schedule()` -> the wire `scheduler_output` (docs/protocol.md, execute_model) ->
the worker's `execute_model` -> `update_from_output()`, which appends the sampled tokens and
checks stops. Policy: continuous batching; running requests first (decodes and unfinished
chunked prefills), then FCFS admission of waiting ones under a token budget and a sequence cap;
chunked prefill; prefix caching; preemption by recompute when blocks run out. Speculative
decoding as vLLM's: a running request's drafts (`update_draft_token_ids`, from the worker's
take_draft_token_ids or `propose_ngram`) are scheduled with it (budget and blocks for the k extra
slots), and `num_computed_tokens` is rolled back by the drafts the worker rejected. With
`num_decode_steps` n > 1, a step that only decodes (every running request, nothing waiting) asks
the worker for up to n tokens a request in one call (blocks for the n - 1 positions past the step
when they are free, else as far as the blocks go).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from sidecar.scheduler import images
from sidecar.scheduler.blocks import BlockManager
from sidecar.scheduler.kv_store import Lookup, StoreTier, full_block_hashes
from sidecar.scheduler.request import Event, Request, Status

__all__ = ["Event", "Request", "Scheduler", "Status", "prefix_caching_offered", "run"]


def prefix_caching_offered(kv_cache_spec: dict | None) -> bool:
    """False when a layer keeps recurrent state (spec type "mamba", `prefix_caching: false`): its
    state cannot be rebuilt from cached blocks, so every request is computed from position 0."""
    return not any(s.get("prefix_caching") is False for s in (kv_cache_spec or {}).values())


class Scheduler:
    def __init__(
        self, *, num_blocks: int, block_size: int, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
        eos_token_ids: Sequence[int] = (), enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
        max_model_len: int = 0, kv_store_lookup: Lookup | None = None, num_decode_steps: int = 1,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or long_prefill_token_threshold < 0 or num_decode_steps < 1:
            raise ValueError("need max_num_seqs >= 1, max_num_batched_tokens >= 1, long_prefill_token_threshold >= 0, "
                             "num_decode_steps >= 1")
        self.num_decode_steps = num_decode_steps
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len  # 0: unknown (drafts are then capped by max_tokens only)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every request the next step's finished_req_ids hasn't dropped
        self.waiting: deque[Request] = deque()  # new and preempted requests, FCFS
        self.running: list[Request] = []  # in admission order; preemption takes from the end
        self._finished_ids: list[str] = []  # finished or aborted since the last step, known to the worker
        # the worker's disk KV tier (kv_store.py): its kv_store_lookup, e.g. RemoteWorker.kv_store_lookup
        self.store = StoreTier(kv_store_lookup, block_size) if kv_store_lookup and enable_prefix_caching else None
        self.encoder = images.EncoderSchedule()

    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        # The worker writes every position but the last sampled token's; a request that can't fit
        # in the whole pool alone would preempt itself forever.
        need = self.blocks.blocks_for(len(req.prompt_token_ids) + req.max_tokens - 1)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {req.req_id!r} needs {need} blocks, the pool has {self.blocks.num_blocks}")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_ids(self) -> bool:
        """Finished requests the worker still holds state for (the next step drops them)."""
        return bool(self._finished_ids)

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        (self.running if req.status is Status.RUNNING else self.waiting).remove(req)
        self._finish(req, "abort")

    # -- the step -----------------------------------------------------------------------------

    def _num_new_tokens(self, req: Request, budget: int, num_computed: int) -> int:
        n = req.num_tokens + len(req.spec_token_ids) - num_computed
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return min(n, budget)

    def _preempt(self, req: Request) -> None:
        # Recompute, not swap: drop its blocks (their full ones stay cached, so resuming may hit
        # them) and recompute prompt + outputs later. The worker keeps the output tokens too.
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> dict:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[dict] = []
        cached: list[tuple[Request, int, bool]] = []  # (req, blocks the worker holds, resumed)
        preempted: list[str] = []
        spec: dict[str, list[int]] = {}

        # 1. Running requests, in admission order. Out of blocks: preempt the most recently
        # admitted one (maybe req itself, then nothing after it is left to schedule).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget, req.num_computed_tokens)
            num_blocks = len(req.block_table)
            while not self.blocks.append_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                num_scheduled[req.req_id] = n
                budget -= n
                k = req.num_computed_tokens + n - req.num_tokens  # the drafts that fit the budget
                if k > 0:
                    spec[req.req_id] = req.spec_token_ids[:k]
                req.spec_token_ids = []
                cached.append((req, num_blocks, False))
                i += 1

        # 2. Waiting requests, FCFS: none after a preemption (blocks are short), and the first
        # that doesn't fit blocks the queue.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Hidden states are not cached: only last-token pooling may skip a cached prefix.
            pooled_all = req.pooling_params is not None and req.pooling_params.get("pooling_type") != "LAST"
            hits = [] if pooled_all else self.blocks.cached_prefix(req)
            stored = 0
            if self.store is not None and not pooled_all:
                hashes = full_block_hashes(req, (req.num_tokens - 1) // self.block_size, self.block_size)
                stored = self.store.match(req, hashes, len(hits))
            num_computed = (len(hits) + stored) * self.block_size
            n = self._num_new_tokens(req, budget, num_computed)
            if not self.blocks.allocate(req, num_computed + n, hits):
                break
            self.waiting.popleft()
            if self.store is not None:
                self.store.admitted(req, len(hits), stored)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            num_scheduled[req.req_id] = n
            budget -= n
            if req.sent:  # resumed after preemption: the worker replaces its table with this one
                cached.append((req, 0, True))
            else:
                req.sent = True
                new_reqs.append({"req_id": req.req_id, "prompt_token_ids": list(req.prompt_token_ids),
                                 "block_ids": [req.block_table],  # (copied below, once any extra blocks are in)
                                 "num_computed_tokens": num_computed,
                                 **({"sampling_params": req.wire_sampling_params(), "lora_request": None,
                                     "mm_features": images.sent(req.mm_features, num_computed, self.encoder.held)}
                                    if req.pooling_params is None else {"pooling_params": req.pooling_params})})

        steps = self._decode_steps(num_scheduled, spec)
        for req in self.running if steps > 1 else ():  # blocks for the positions past the step, if free
            self.blocks.append_slots(req, num_scheduled[req.req_id] - 1 + self._ahead(req, steps))
        for nr in new_reqs:
            nr["block_ids"] = [list(nr["block_ids"][0])]
        finished, self._finished_ids = self._finished_ids, []
        for req_id in finished:
            del self.requests[req_id]
        encode = self.encoder.schedule((r.req_id, r.mm_features, r.num_computed_tokens, num_scheduled[r.req_id])
                                       for r in self.running if r.mm_features and r.req_id in num_scheduled)
        free = self.encoder.evict({f["identifier"] for r in self.requests.values() if not r.is_finished
                                   for f in r.mm_features})
        return {
            "scheduled_new_reqs": new_reqs,
            "scheduled_cached_reqs": {
                "req_ids": [r.req_id for r, _, _ in cached],
                "resumed_req_ids": [r.req_id for r, _, resumed in cached if resumed],
                "new_token_ids": [[] for _ in cached],  # the worker appends the tokens it sampled itself
                "new_block_ids": [[r.block_table[b:]] if len(r.block_table) > b else None for r, b, _ in cached],
                "num_computed_tokens": [r.num_computed_tokens for r, _, _ in cached],
                "num_output_tokens": [len(r.output_token_ids) for r, _, _ in cached],
            },
            "num_scheduled_tokens": num_scheduled,
            "total_num_scheduled_tokens": sum(num_scheduled.values()),
            "scheduled_spec_decode_tokens": spec,
            "num_common_prefix_blocks": [0],
            "finished_req_ids": finished,
            "preempted_req_ids": preempted,
            **(self.store.fields(self.requests, num_scheduled, spec) if self.store is not None else {}),
            "scheduled_encoder_inputs": encode,
            "free_encoder_mm_hashes": free,
            **({"num_decode_steps": steps} if steps > 1 else {}),
        }

    def _decode_steps(self, num_scheduled: dict[str, int], spec: dict) -> int:
        """num_decode_steps for this step: n when every running request is in it and decodes (it has
        its first token: a new request's comes back at once), with no drafts, and nothing waits (else
        1: the worker returns one token a request)."""
        if self.num_decode_steps == 1 or self.waiting or spec or self.store is not None \
                or len(num_scheduled) != len(self.running):
            return 1
        plain = all(r.num_computed_tokens + num_scheduled[r.req_id] == r.num_tokens and r.output_token_ids
                    for r in self.running)
        return self.num_decode_steps if plain else 1

    def _ahead(self, req: Request, steps: int) -> int:
        """How many of up to `steps` tokens the worker may decode for `req` (max_tokens, max_model_len):
        the step's own position and those of the tokens after its first."""
        n = min(steps, req.max_tokens - len(req.output_token_ids))
        return max(1, min(n, self.max_model_len - req.num_tokens) if self.max_model_len else n)

    def update_from_output(self, scheduler_output: dict, model_runner_output: dict) -> list[Event]:
        index = model_runner_output["req_id_to_index"]
        sampled = model_runner_output["sampled_token_ids"]
        pooled = model_runner_output.get("pooler_output") or [None] * len(sampled)
        spec = scheduler_output.get("scheduled_spec_decode_tokens") or {}
        events: list[Event] = []
        nst = scheduler_output["num_scheduled_tokens"]
        steps = scheduler_output.get("num_decode_steps", 1)
        failed = StoreTier.rewinds(self.requests, nst, model_runner_output, self.block_size) if self.store else ()
        for req_id, n in nst.items():
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING or req_id in failed:
                continue  # aborted after this step was scheduled, or its store load failed (recomputed)
            k = len(spec.get(req_id, ()))
            req.num_computed_tokens += n - k
            new = list(sampled[index[req_id]])
            if req.pooling_params is not None:
                done = req.num_computed_tokens == req.num_tokens
                if new or done != (pooled[index[req_id]] is not None):
                    raise ValueError(f"worker returned {new} / pooler_output for pooling request {req_id!r} at "
                                     f"{req.num_computed_tokens}/{req.num_tokens} tokens")
                self.blocks.cache_blocks(req)
                if done:
                    req.pooled = pooled[index[req_id]]
                    self.running.remove(req)
                    self._finish(req, "stop")
                    events.append(Event(req_id, [], True, "stop", req.pooled))
                continue
            # The worker samples exactly when the computed tokens reach the end of the known ones,
            # and returns 1..k+1 tokens for k drafts.
            sample = req.num_computed_tokens == req.num_tokens
            if not (1 <= len(new) <= k + steps if sample else not new):
                raise ValueError(
                    f"worker returned {new} for {req_id!r} at {req.num_computed_tokens}/{req.num_tokens} tokens, {k} drafts")
            if not new:
                self.blocks.cache_blocks(req)
                continue  # a chunk of a longer prefill
            req.num_computed_tokens += len(new) - 1  # the accepted drafts (rejected: rolled back), or decoded
            self.num_draft_tokens += k
            self.num_accepted_tokens += min(k, len(new) - 1)
            reason = None
            for i, tok in enumerate(new):  # a stop inside the accepted drafts (or decode steps) drops the rest
                req.output_token_ids.append(tok)
                reason = self._check_stop(req)
                if reason is not None:
                    new = new[: i + 1]
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    break
            self.blocks.cache_blocks(req)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            events.append(Event(req_id, new, reason is not None, reason))
        return events

    def update_draft_token_ids(self, drafts: dict | None) -> None:
        """vLLM's DraftTokenIds ({req_ids, draft_token_ids}, or None) for the next step, capped so
        that accepted drafts plus the bonus token never pass max_tokens or max_model_len."""
        if not drafts:
            return
        for req_id, d in zip(drafts["req_ids"], drafts["draft_token_ids"]):
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            k = req.max_tokens - len(req.output_token_ids) - 1
            if self.max_model_len:
                k = min(k, self.max_model_len - req.num_tokens)
            req.spec_token_ids = list(d[: max(0, k)])

    def propose_ngram(self, k: int, n_min: int = 2, n_max: int = 5) -> dict | None:
        """Prompt-lookup drafts computed here, for a worker that proposes none itself."""
        import numpy as np

        from sidecar.engine.ngram import ngram_drafts

        ids, drafts = [], []
        for req in self.running:
            if req.num_computed_tokens == req.num_tokens - 1:
                d = ngram_drafts(np.asarray(req.all_token_ids, np.int32), n_min, n_max, k)
                if d:
                    ids.append(req.req_id)
                    drafts.append(d)
        return {"req_ids": ids, "draft_token_ids": drafts} if ids else None

    def _check_stop(self, req: Request) -> str | None:
        # vLLM's order: min_tokens holds off stops, then eos, stop ids, and length.
        num_out, last = len(req.output_token_ids), req.output_token_ids[-1]
        if num_out < req.min_tokens:
            return None
        if (not req.ignore_eos and last in self.eos_token_ids) or last in req.stop_token_ids:
            req.stop_reason = last
            return "stop"
        return "length" if num_out >= req.max_tokens else None

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.blocks.free(req)  # its full computed blocks stay cached for later prompts
        if req.sent:
            self._finished_ids.append(req.req_id)
        else:
            del self.requests[req.req_id]  # the worker never saw it: nothing to drop there


def run(
    scheduler: Scheduler, execute_model: Callable[[dict], dict], on_event: Callable[[Event], None] | None = None,
    take_draft_token_ids: Callable[[], dict | None] | None = None,
) -> dict[str, Request]:
    """Step until no request is unfinished; returns every request seen (by id).

    Ends with a step that carries only finished_req_ids (no tokens) when the last requests
    finished, as vLLM's engine does, so the worker frees their state: the worker must accept a
    step with total_num_scheduled_tokens == 0. `on_event` may add or abort requests.
    `take_draft_token_ids` (the worker's, or `scheduler.propose_ngram`) gives the next step's drafts.
    """
    seen: dict[str, Request] = {}
    while scheduler.has_unfinished() or scheduler.has_finished_ids():
        seen.update(scheduler.requests)
        out = scheduler.schedule()
        for event in scheduler.update_from_output(out, execute_model(out)):
            if on_event is not None:
                on_event(event)
        if take_draft_token_ids is not None and out["total_num_scheduled_tokens"]:
            scheduler.update_draft_token_ids(take_draft_token_ids())
    return seen
