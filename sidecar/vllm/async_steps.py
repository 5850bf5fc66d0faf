"""vLLM's async scheduling through the worker class: step n + 1 is sent before step n's reply is read.

With `--async-scheduling` vLLM's EngineCore keeps two steps in flight: it schedules step n + 1
while step n runs, and reads step n's output only then. The worker class sends each step as soon
as vLLM hands it over and returns vLLM's `AsyncModelRunnerOutput`, whose `get_output()` (called by
vLLM's output thread, or by EngineCore itself with the in-process executor) reads the reply. So
the sidecar's MLX thread finds step n + 1 queued when it finishes step n, while vLLM schedules,
detokenises and streams.

The steps go alternately over two connections, numbered (`step_id`): the sidecar hands them to its
MLX thread in step order (docs/protocol.md, "Pipelined steps"). vLLM's async scheduler lists a
request of step n in step n + 1 without its new token (empty `new_token_ids`, as without async
scheduling): the sidecar decodes the token it sampled itself. The first step after a reset is
waited for, so the sidecar's step order is settled before two are in flight.

Guarantees kept: exactly once (a reply lost on the way is re-read by resending the same numbered
step on a fresh connection; the sidecar answers a step it already applied from the replies it
keeps), and instance pinning (every step names the sidecar instance the worker started with: a
restarted sidecar answers 409). A sidecar that is gone (resends spent) or restarted is recovered
(sidecar/vllm/recovery.py): the worker's record follows the replies as they are read, in step
order, so after the new instance is rebuilt and refilled up to the last step answered, the steps
still in flight are sent to it again (`replay`), the oldest read before the next goes out.

What runs one step at a time instead (the caller drains the steps in flight first): steps with
structured-output requests (their grammar bitmask follows the forward, `sample_tokens`), and with
speculative decoding async scheduling is off altogether (sidecar/vllm/platform.py). LoRA,
preemption and prefix hits need nothing: they are in the step itself. No MLX.
"""

from __future__ import annotations

import http.client
import threading
from collections import deque
from typing import Any, Callable

import msgpack
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from sidecar.client.http1 import Connection
from sidecar.client.remote import _LOST, MSGPACK, RemoteError, RemoteWorker, connect, result_of
from sidecar.vllm.recovery import Recovering, SidecarLost, is_lost


class Reply:
    """One numbered step in flight on one connection; `result()` reads its reply once, from any thread."""

    def __init__(self, steps: "AsyncSteps", slot: int, scheduler_output: dict, step_id: int):
        self.steps, self.slot, self.scheduler_output, self.step_id = steps, slot, scheduler_output, step_id
        self.body, self.headers = b"", {}
        self.sent = False
        self.out: dict | None = None  # the reply, once read (by `result()`, or by a recovery's replay)
        self._lock = threading.Lock()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self) -> Any:
        with self._lock:
            if not self._done:
                try:
                    self._value = self.steps._read(self)
                except BaseException as e:  # noqa: BLE001 - re-raised to every reader
                    self._error = e
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value


class Output(AsyncModelRunnerOutput):
    def __init__(self, reply: Reply, convert: Callable[[dict | BaseException], ModelRunnerOutput]):
        self.reply, self.convert = reply, convert

    def get_output(self) -> ModelRunnerOutput:
        try:
            out = self.reply.result()
        except (*_LOST, SidecarLost) as e:  # the sidecar is gone and was not recovered: the caller names it
            return self.convert(e)
        return self.convert(out)


class AsyncSteps:
    """`recovering`: the worker's Recovering (sidecar/vllm/recovery.py). Every reply read is recorded
    there in step order, so its ledger holds exactly the steps answered; a sidecar lost with steps
    in flight is recovered, and those steps are sent again to the new instance (`replay`)."""

    def __init__(self, remote: RemoteWorker, resends: int = 3, recovering: Recovering | None = None):
        self.remote, self.resends, self.recovering = remote, resends, recovering
        self._conns: list[Connection | None] = [None, None]
        self._last: list[Reply | None] = [None, None]  # the last step sent on each connection
        self._inflight: deque[Reply] = deque()
        self._sent = 0
        self._settled = False  # the sidecar has handed one of our numbered steps to its MLX thread
        self._lock = threading.RLock()  # sending, and recovering (vLLM may read replies from another thread)
        self.resent = 0
        self.replayed = 0
        if recovering is not None:
            recovering.in_flight = self.replay

    def execute(self, scheduler_output: dict, step_id: int,
                convert: Callable[[dict | BaseException], ModelRunnerOutput]) -> Output:
        """The step, sent now; vLLM reads its output later."""
        return Output(self.submit(scheduler_output, step_id), convert)

    def submit(self, scheduler_output: dict, step_id: int) -> Reply:
        """Send a numbered execute_model now; its reply is read later (Reply.result)."""
        slot = self._sent % 2
        prev = self._last[slot]
        if prev is not None:
            prev.result()  # vLLM has read it by now (two in flight); the connection is free again
        with self._lock:
            reply = Reply(self, slot, scheduler_output, step_id)
            self._sent += 1
            self._last[slot] = reply
            self._inflight.append(reply)
            while self._inflight and self._inflight[0].out is not None:
                self._inflight.popleft()
            try:
                self._send(reply)
            except (OSError, http.client.HTTPException):  # gone: reading the reply sends it again, or recovers
                self._drop(slot)
        if not self._settled:
            reply.result()  # the first step after a reset: settled before a second one is in flight
            self._settled = True
        return reply

    def drain(self) -> None:
        """Read every reply in flight (before a step that runs on its own, or a lifecycle call)."""
        while self._inflight:
            self._inflight.popleft().result()

    def reset(self) -> None:
        """After the sidecar's step numbering restarted (init_device): close, settle again."""
        for i in range(2):
            self._drop(i)
            self._last[i] = None
        self._inflight.clear()
        self._settled = False

    def close(self) -> None:
        self.reset()

    def replay(self) -> int:
        """On a rebuilt instance (called by Recovering after the refill): the steps in flight again,
        in step order, the oldest read before the next is sent (the new instance settles first).
        Lost again: raised, and Recovering rebuilds once more (the ledger then holds what was read)."""
        with self._lock:
            pending = [r for r in self._inflight if r.out is None]
            for i in range(2):
                self._drop(i)
            for r in pending:
                r.sent = False
            for k, r in enumerate(pending):
                self._send(r)
                if k == 0:
                    self._receive(r)
            self.replayed += len(pending)
            return len(pending)

    def _drop(self, slot: int) -> None:
        conn, self._conns[slot] = self._conns[slot], None
        if conn is not None:
            conn.close()

    def _conn(self, slot: int) -> Connection:
        if self._conns[slot] is None:
            self._conns[slot] = connect(self.remote.url, self.remote.timeout)
        return self._conns[slot]

    def _send(self, reply: Reply) -> None:
        """Sent to the current instance, as it must see it (a resend repeats the same bytes)."""
        headers = {"content-type": MSGPACK}
        if self.remote._headers.get("authorization"):
            headers["authorization"] = self.remote._headers["authorization"]
        if self.remote.instance_id:
            headers["x-sidecar-expect-instance"] = self.remote.instance_id
        if not reply.body or headers != reply.headers:  # packed once per instance
            so = reply.scheduler_output if self.recovering is None else self.recovering.as_sent(reply.scheduler_output)
            reply.body = msgpack.packb({"scheduler_output": so, "step_id": reply.step_id}, use_bin_type=True)
            reply.headers = headers
        reply.sent = False
        self._conn(reply.slot).request("POST", "/rpc/execute_model", body=reply.body, headers=reply.headers)
        reply.sent = True

    def _receive(self, reply: Reply) -> dict:
        resp = self._conn(reply.slot).getresponse()
        out = result_of(resp, resp.read())
        with self._lock:  # replies are read in step order: the ledger follows them
            if self.recovering is not None:
                self.recovering.applied(reply.scheduler_output, out)
            reply.out = out
        return out

    def _overtook(self, reply: Reply, e: BaseException) -> bool:
        """Step n + 1 reached the sidecar before step n (whose connection was slower, e.g. opened
        anew after a lost reply) and waited there longer than the sidecar waits: a 409 that ran
        nothing. Once step n is answered (replies are read in order), the same step is in sequence."""
        if not (isinstance(e, RemoteError) and e.status == 409 and e.type == "step_out_of_sequence"):
            return False
        with self._lock:
            return all(r.out is not None for r in self._inflight if r.step_id < reply.step_id)

    def _read(self, reply: Reply) -> Any:
        attempt = reordered = recoveries = 0
        while reply.out is None:
            try:
                if not reply.sent:  # a lost reply: the same numbered step again, on a fresh connection
                    self._send(reply)
                self._receive(reply)
            except Exception as e:
                if self._overtook(reply, e) and reordered < self.resends:
                    reordered += 1  # rejected, nothing ran; the step before it is answered now: in sequence
                    reply.sent = False
                    continue
                lost = isinstance(e, _LOST)
                if not lost and not (self.recovering is not None and is_lost(e)):
                    raise
                with self._lock:
                    if reply.out is not None:  # a recovery on another thread replayed it meanwhile
                        break
                    self._drop(reply.slot)
                    reply.sent = False
                    if lost and attempt < self.resends:
                        attempt += 1
                        self.resent += 1
                        continue
                    if self.recovering is None or recoveries == 4:  # lost again right after each recovery
                        raise
                    # Gone, or another instance answers: rebuilt, and the steps in flight sent again (`replay`).
                    self.recovering.recover_or_fail(e)
                    attempt, recoveries = 0, recoveries + 1
        return reply.out
