"""Surviving a sidecar restart under a running vLLM: every RPC of the worker class goes through
`Recovering.call`, which records what a new sidecar instance needs and, when the sidecar is lost
(unreachable, or another instance answers), waits for it and rebuilds it before the call is
replayed, so vLLM sees one slow step.

1. Detect and wait: a connection error, a lost reply that the step resends did not recover, a 503
   from a draining server or 409 `instance_mismatch`. The worker polls `/readyz` for up to
   `recover_timeout` seconds (logging once what it waits for); then fails naming the URL.
2. Rebuild: the start-up calls vLLM made (`init_device` with reset, `load_model`,
   `determine_available_memory` with the bytes the first instance found, so no profile forward
   runs again, the cache initialisation with the same block count), checked
   against the model of the first instance; LoRA adapters re-added; sleep restored.
3. Refill: from the ledger (sidecar/vllm/ledger.py), every block vLLM may still read is written
   again from the tokens the worker class saw for it: each live request's computed tokens into
   its own blocks, and, with prefix caching, the full blocks of finished requests that vLLM's
   prefix cache may still hit. Plain prefill steps that stop before each request's last known
   token, so nothing is sampled; a request's generated tokens go in `prefill_token_ids`, so the
   sidecar counts them as generated (penalties, and a seeded request's stream position).
4. Resume: the interrupted call runs as vLLM asked (a deferred `sample_tokens` after its
   `execute_model`). With async scheduling, the steps sent ahead whose replies were not read yet
   (the ledger follows replies, so it holds none of them) are sent again first, in order, by the
   `in_flight` hook (sidecar/vllm/async_steps.py): vLLM reads exactly the replies it waits for,
   each step applied once by the instance that answers it. Requests preempted before the restart
   come back in a later step as vLLM's resumed requests; the new instance never saw them, so
   those entries are sent as new requests with their tokens (`prefill_token_ids`) and the table
   vLLM gave.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any, Callable

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.vllm.ledger import Ledger, reached, refill_items, refill_steps

log = logging.getLogger(__name__)

# What identifies the model a sidecar serves (get_model): another value after a restart is fatal.
MODEL_KEYS = ("name", "path", "type", "num_layers", "hidden_size", "vocab_size", "params", "dtype", "quantization")
_START_UP = ("init_device", "load_model", "determine_available_memory", "initialize_cache", "initialize_from_config")


class SidecarLost(RuntimeError):
    """The sidecar did not come back, or came back unable to serve the same state."""


def is_lost(e: BaseException) -> bool:
    if isinstance(e, RemoteError):
        return (e.status == 409 and e.type == "instance_mismatch") or (e.status == 503 and e.type == "unavailable")
    return isinstance(e, (OSError, http.client.HTTPException))


class Recovering:
    def __init__(self, remote: RemoteWorker, *, where: str, recover_timeout: float, block_size: int,
                 budget: int, max_seqs: int, prefix_cache: bool,
                 bring_up: Callable[[RemoteWorker], None] | None = None):
        self.remote, self.where, self.recover_timeout = remote, where, recover_timeout
        self.budget, self.max_seqs, self.prefix_cache = budget, max_seqs, prefix_cache
        self.ledger = Ledger(block_size)
        self.bring_up = bring_up  # a scheduler's own start-up, instead of replaying the recorded calls
        self.start_up: dict[str, dict] = {}  # method -> kwargs, in the order vLLM called them
        self.model: dict | None = None
        self.loras: dict[int, dict] = {}
        self.sleeping: int | None = None
        self.deferred: dict | None = None  # execute_model(defer_sampling) kwargs awaiting sample_tokens
        self.fresh: set[str] = set()  # preempted before a restart: the new instance never saw them
        self.recoveries = 0
        self.last: dict = {}  # the last recovery's durations and refilled tokens
        self._t_refill = 0.0
        self.broken = False  # the ledger missed a step: recovery would restore a wrong state
        self.instance: str | None = None  # the instance of the last successful call (a 409's header is the new one)
        # Steps sent ahead and not answered yet (async scheduling): sent again on a new instance after the refill.
        self.in_flight: Callable[[], int] | None = None

    def adopt(self, num_blocks: int) -> None:
        """A worker brought up outside `call` (a preloaded server, a scheduler's own lifecycle calls):
        a new instance must serve its model with `num_blocks` blocks; `bring_up` starts it up."""
        self.model = self.remote.call("get_model")
        self.instance = self.remote.instance_id
        self.start_up = {"initialize_cache": {"num_gpu_blocks": num_blocks, "num_cpu_blocks": 0}}

    # --- the call path ----------------------------------------------------------------------

    def call(self, method: str, **kwargs: Any) -> Any:
        for attempt in range(4):  # a sidecar lost again right after recovering: recover again, a few times
            try:
                if attempt and method == "sample_tokens" and self.deferred is not None:
                    self.remote.call("execute_model", **self._send(self.deferred))  # its first phase, again
                result = self.remote.call(method, **self._send(kwargs) if method == "execute_model" else kwargs)
                break
            except Exception as e:
                if not is_lost(e) or attempt == 3:
                    raise
                if not self.recover_or_fail(e) and method == "execute_model" and kwargs.get("step_id") is None:
                    raise  # the same instance, an unnumbered step: it may have run, a resend could run it twice
        self.instance = self.remote.instance_id
        self._observe(method, kwargs, result)
        return result

    def recover_or_fail(self, e: BaseException) -> bool:
        """The sidecar was lost (`is_lost(e)`): recover (True: a new instance was rebuilt, False: the
        same one answers again), or SidecarLost when it cannot be."""
        if "initialize_cache" not in self.start_up and "initialize_from_config" not in self.start_up:
            raise SidecarLost(f"{self.where} was lost during start-up: {e}") from e
        if self.broken:
            raise SidecarLost(f"{self.where} was lost ({e}) and cannot be recovered: the recovery "
                              "record missed a step (logged above)") from e
        return self.recover(e)

    def _send(self, kwargs: dict) -> dict:
        if not self.fresh:
            return kwargs
        return {**kwargs, "scheduler_output": self.as_sent(kwargs["scheduler_output"])}

    def as_sent(self, so: dict) -> dict:
        """A scheduler_output as the current instance must get it (resumed requests it never saw, as new)."""
        return self._unresume(so) if self.fresh else so

    def _observe(self, method: str, kwargs: dict, result: Any) -> None:
        if method in _START_UP:
            if method == "init_device":
                self.start_up.clear()
                self.loras.clear()
            if method.startswith("initialize_"):
                self.start_up.pop("initialize_cache", None)
                self.start_up.pop("initialize_from_config", None)
            self.start_up[method] = kwargs
            if method == "determine_available_memory" and isinstance(result, int) and result > 0:
                # A new instance is held to the bytes this one measured: checked against its memory,
                # without running the activation profile (a forward of the whole token budget) again.
                self.start_up[method] = {"kv_cache_memory_bytes": result}
            if method in ("init_device", "initialize_cache", "initialize_from_config"):
                self.ledger.clear()
                self.broken = False
            if method == "load_model":
                self.model = self.remote.call("get_model")
        elif method == "execute_model":
            if kwargs.get("defer_sampling"):
                self.deferred = kwargs
            else:
                self.applied(kwargs["scheduler_output"], result)
        elif method == "sample_tokens":
            if self.deferred is not None:
                self.applied(self.deferred["scheduler_output"], result)
            self.deferred = None
        elif method == "add_lora" and kwargs.get("lora_request"):
            self.loras[kwargs["lora_request"]["lora_int_id"]] = kwargs["lora_request"]
        elif method == "remove_lora":
            self.loras.pop(kwargs["lora_id"], None)
        elif method == "sleep":
            self.sleeping = kwargs.get("level", 1)
            self.ledger.clear()
        elif method == "wake_up":
            self.sleeping = None

    def applied(self, so: dict, out: dict) -> None:
        """A step the current instance applied (also for steps sent outside `call`: async ones)."""
        self.instance = self.remote.instance_id
        if self.broken:
            return
        try:
            self.ledger.apply(so, out)
        except Exception:  # bookkeeping must never fail a step that ran: only recovery is given up
            log.exception("%s: the recovery record could not follow this step; a restart of the sidecar "
                          "will fail the engine instead of being recovered", self.where)
            self.broken = True
        if self.fresh:  # the instance knows these now
            self.fresh -= {*(so.get("finished_req_ids") or ()), *(r["req_id"] for r in so.get("scheduled_new_reqs") or ()),
                           *((so.get("scheduled_cached_reqs") or {}).get("req_ids") or ())}

    def _unresume(self, so: dict) -> dict:
        """Resumed requests the current instance never saw, as new requests (same body on a resend)."""
        c = so.get("scheduled_cached_reqs") or {}
        move = [i for i, rid in enumerate(c.get("req_ids") or ()) if rid in self.fresh and rid in set(c.get("resumed_req_ids") or ())]
        if not move:
            return so
        new = list(so.get("scheduled_new_reqs") or ())
        encode = {k: list(v) for k, v in (so.get("scheduled_encoder_inputs") or {}).items()}
        for i in move:
            rid = c["req_ids"][i]
            r = self.ledger.parked.get(rid) or self.ledger.live[rid]
            known = (c.get("all_token_ids") or {}).get(rid) or r.tokens
            at = c["num_computed_tokens"][i]
            mm = self.ledger.features(r, at, len(r.prompt))
            new.append({"req_id": rid, "prompt_token_ids": r.prompt, "prefill_token_ids": list(known),
                        "sampling_params": r.sampling_params, "block_ids": c["new_block_ids"][i],
                        "num_computed_tokens": at, "lora_request": r.lora_request, "mm_features": mm})
            # The new instance never encoded its images: those this step reaches run now.
            reach = reached(mm, at, at + (so.get("num_scheduled_tokens") or {}).get(rid, 0))
            if reach:
                encode[rid] = sorted({*encode.get(rid, ()), *reach})
        keep = [i for i in range(len(c["req_ids"])) if i not in set(move)]
        cached = {k: ([v[i] for i in keep] if isinstance(v, list) and len(v) == len(c["req_ids"]) else v)
                  for k, v in c.items()}
        cached["resumed_req_ids"] = [r for r in c.get("resumed_req_ids") or () if r not in self.fresh]
        cached["all_token_ids"] = {k: v for k, v in (c.get("all_token_ids") or {}).items() if k not in self.fresh}
        return {**so, "scheduled_new_reqs": new, "scheduled_cached_reqs": cached,
                **({"scheduled_encoder_inputs": encode} if encode else {})}

    # --- recovery ---------------------------------------------------------------------------

    def recover(self, cause: BaseException) -> bool:
        """Wait for the sidecar; True when a new instance was rebuilt, False when the same one answers again."""
        old = self.instance
        started = time.monotonic()
        deadline = started + self.recover_timeout
        log.warning("%s lost (%s): waiting up to %.0fs for it to come back (mlx_sidecar.recover_timeout)",
                    self.where, cause, self.recover_timeout)
        while True:
            body = self._wait(deadline, cause)
            t0 = time.monotonic()
            self.remote.instance_id = old
            if body.get("instance_id") == old and self._same_instance_answers():
                log.warning("%s answers again as the same instance: the call is retried", self.where)
                return False
            try:
                tokens = self._rebuild()
                t_refilled = time.monotonic()
                replayed = self.in_flight() if self.in_flight is not None else 0
            except Exception as e:
                if not is_lost(e):
                    raise
                cause = e  # lost again while rebuilding: wait again (the rebuild starts over)
                continue
            self.recoveries += 1
            now = time.monotonic()
            self.last = {"waited_s": t0 - started, "start_up_s": self._t_refill - t0, "rebuild_s": now - t0,
                         "refill_s": t_refilled - self._t_refill, "replay_s": now - t_refilled, "tokens": tokens,
                         "replayed_steps": replayed}
            log.warning("%s recovered: new instance %s rebuilt in %.2fs (refill of %d tokens: %.2fs; %d steps in "
                        "flight sent again; recovery %d)", self.where, self.remote.instance_id, self.last["rebuild_s"],
                        tokens, self.last["refill_s"], replayed, self.recoveries)
            # One machine-readable line per recovery (vLLM's process has no metrics registry of ours).
            log.warning("mlx_sidecar_recovery %s", json.dumps({
                "recoveries_total": self.recoveries, "where": self.where, "url": self.remote.url,
                "old_instance": old, "new_instance": self.remote.instance_id, "cause": str(cause)[:200],
                "duration_s": round(now - started, 3), "refilled_tokens": tokens, "replayed_steps": replayed,
                **{k: round(v, 3) for k, v in self.last.items() if k.endswith("_s")}}, sort_keys=True))
            return True

    def _wait(self, deadline: float, cause: BaseException) -> dict:
        """/readyz of a server that is up (not starting a preload, not draining)."""
        while True:
            self.remote.close()
            try:
                _, body = self.remote.readyz()
                if body.get("starting") is None and not body.get("draining"):
                    return body
            except (OSError, http.client.HTTPException, RemoteError):
                pass
            if time.monotonic() > deadline:
                raise SidecarLost(f"{self.where} did not come back within mlx_sidecar.recover_timeout "
                                  f"({self.recover_timeout:.0f}s); the last error was: {cause}") from cause
            time.sleep(0.05)  # a local poll; the new instance's start-up is seconds

    def _same_instance_answers(self) -> bool:
        try:
            self.remote.call("check_health")
            return True
        except Exception as e:
            if is_lost(e):
                return False
            raise

    def _rebuild(self) -> int:
        self.remote.close()
        self.remote.instance_id = None  # pin the new instance from its first reply
        if self.bring_up is not None:
            self.bring_up(self.remote)
        else:
            self.remote.call("init_device", **self.start_up["init_device"])
            self.remote.call("load_model")
        model = self.remote.call("get_model")
        theirs = {k: model.get(k) for k in MODEL_KEYS}
        ours = {k: (self.model or {}).get(k) for k in MODEL_KEYS}
        if theirs != ours:
            raise SidecarLost(f"{self.where} came back serving another model: {_model_name(theirs)} instead of "
                              f"{_model_name(ours)} (differs in {', '.join(k for k in MODEL_KEYS if theirs[k] != ours[k])})")
        for method in ("determine_available_memory", "initialize_from_config", "initialize_cache"):
            if method in self.start_up:
                try:
                    self.remote.call(method, **self.start_up[method])
                except RemoteError as e:
                    if e.status != 400:
                        raise
                    raise SidecarLost(f"{self.where} came back but cannot hold the KV cache vLLM sized at "
                                      f"start-up ({method}: {e})") from e
        for lora in self.loras.values():
            self.remote.call("add_lora", lora_request=lora)
        self._t_refill = time.monotonic()
        if self.sleeping is not None:
            self.remote.call("sleep", level=self.sleeping)
            return 0
        items = refill_items(self.ledger, self.prefix_cache, set(self.loras))
        tokens = sum(it.total - it.done for it in items)
        for step in refill_steps(items, self.ledger.block_size, self.budget, self.max_seqs):
            self.remote.call("execute_model", scheduler_output=step)
        self.fresh = set(self.ledger.parked)
        return tokens


def _model_name(m: dict) -> str:
    return f"{m.get('name')} ({m.get('type')}, {m.get('params')} parameters, at {m.get('path')})"
