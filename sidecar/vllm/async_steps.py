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
restarted sidecar answers 409).

What runs one step at a time instead (the caller drains the steps in flight first): steps with
structured-output requests (their grammar bitmask follows the forward, `sample_tokens`), and with
speculative decoding async scheduling is off altogether (sidecar/vllm/platform.py). LoRA,
preemption and prefix hits need nothing: they are in the step itself. No MLX.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import msgpack
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from sidecar.client.http1 import Connection
from sidecar.client.remote import _LOST, MSGPACK, RemoteWorker, connect, result_of


class Reply:
    """One step in flight on one connection; `result()` reads its reply once, from any thread."""

    def __init__(self, steps: "AsyncSteps", slot: int, body: bytes, headers: dict[str, str]):
        self.steps, self.slot, self.body, self.headers = steps, slot, body, headers
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
    def __init__(self, reply: Reply, convert: Callable[[dict], ModelRunnerOutput]):
        self.reply, self.convert = reply, convert

    def get_output(self) -> ModelRunnerOutput:
        try:
            out = self.reply.result()
        except _LOST as e:  # the sidecar is gone (resends spent): the caller names it
            return self.convert(e)
        return self.convert(out)


class AsyncSteps:
    def __init__(self, remote: RemoteWorker, resends: int = 3):
        self.remote, self.resends = remote, resends
        self._conns: list[Connection | None] = [None, None]
        self._last: list[Reply | None] = [None, None]  # the last step sent on each connection
        self._inflight: deque[Reply] = deque()
        self._sent = 0
        self._settled = False  # the sidecar has handed one of our numbered steps to its MLX thread
        self.resent = 0

    def execute(self, scheduler_output: dict, step_id: int, convert: Callable[[dict], ModelRunnerOutput]) -> Output:
        """The step, sent now; vLLM reads its output later."""
        return Output(self.submit(scheduler_output, step_id), convert)

    def submit(self, scheduler_output: dict, step_id: int) -> Reply:
        """Send a numbered execute_model now; its reply is read later (Reply.result)."""
        slot = self._sent % 2
        prev = self._last[slot]
        if prev is not None:
            prev.result()  # vLLM has read it by now (two in flight); the connection is free again
        body = msgpack.packb({"scheduler_output": scheduler_output, "step_id": step_id}, use_bin_type=True)
        headers = {"content-type": MSGPACK}
        if self.remote._headers.get("authorization"):
            headers["authorization"] = self.remote._headers["authorization"]
        if self.remote.instance_id:
            headers["x-sidecar-expect-instance"] = self.remote.instance_id
        reply = Reply(self, slot, body, headers)
        self._send(reply)
        self._sent += 1
        self._last[slot] = reply
        self._inflight.append(reply)
        while self._inflight and self._inflight[0]._done:
            self._inflight.popleft()
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
        for i, conn in enumerate(self._conns):
            if conn is not None:
                conn.close()
            self._conns[i] = None
            self._last[i] = None
        self._inflight.clear()
        self._settled = False

    def close(self) -> None:
        self.reset()

    def _conn(self, slot: int) -> Connection:
        if self._conns[slot] is None:
            self._conns[slot] = connect(self.remote.url, self.remote.timeout)
        return self._conns[slot]

    def _send(self, reply: Reply) -> None:
        self._conn(reply.slot).request("POST", "/rpc/execute_model", body=reply.body, headers=reply.headers)

    def _read(self, reply: Reply) -> Any:
        for attempt in range(1 + self.resends):
            try:
                if attempt:  # a lost reply: the same numbered step again, on a fresh connection
                    self._send(reply)
                resp = self._conn(reply.slot).getresponse()
                return result_of(resp, resp.read())
            except _LOST:
                conn, self._conns[reply.slot] = self._conns[reply.slot], None
                if conn is not None:
                    conn.close()
                if attempt == self.resends:
                    raise
                self.resent += 1
        raise AssertionError("unreachable")
