"""The reply gate (server/replygate.py): the MLX thread holds its after-reply work until the event
loop has written the reply, never longer than the bound; a gated call is published after its
reply, and `published()` lets a probe wait for it. The lean path opens the gate after the reply's
last ASGI message, and on a failed call too."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from sidecar.server.instance import Instance
from sidecar.server.lean import LeanApp
from sidecar.server.replygate import HOLD_MIN_CALL_SECONDS, HOLD_SECONDS, ReplyGate
from sidecar.server.rpc import MLXThread


def test_the_gate_opens_once_and_its_wait_is_bounded() -> None:
    gate = ReplyGate()
    t0 = time.perf_counter()
    assert not gate.wait(0.01)  # never opened: back after the bound
    assert 0.008 < time.perf_counter() - t0 < 1
    gate.open()
    gate.open()  # (idempotent)
    assert gate.is_open and ReplyGate().is_open is False


class _PatientGate(ReplyGate):
    """A gate whose bound outlasts any stall of a loaded machine: the order of events is then the
    gate's doing alone (with the 2 ms bound, a starved event loop could open it after the hook)."""

    def wait(self, timeout: float = 5.0) -> bool:
        return super().wait(timeout)


def _run_gated(open_after: float | None, call_seconds: float = 2 * HOLD_MIN_CALL_SECONDS,
               gate_type: type[ReplyGate] = ReplyGate) -> tuple[float, list[str], float]:
    """A gated call of `call_seconds`; the gate opened `open_after` seconds after the reply (None:
    never). Returns how long after the reply (as the loop saw it) the hook started, the order of
    events, and how long after the call's end on the MLX thread it started."""
    events: list[str] = []
    hooked = threading.Event()
    started: list[float] = []
    ended: list[float] = []

    def hook() -> None:
        started.append(time.perf_counter())
        events.append("hook")
        hooked.set()

    async def main() -> float:
        t = MLXThread(4, after_reply=hook, after_job=lambda: events.append("published"))
        gate = gate_type()
        try:
            await t.call(lambda: events.append("call") or time.sleep(call_seconds) or ended.append(time.perf_counter()),
                         5, gate)
            replied = time.perf_counter()
            events.append("replied")
            if open_after is not None:
                await asyncio.sleep(open_after)
                events.append("open")
                gate.open()
            assert await asyncio.to_thread(hooked.wait, 5)
            return started[0] - replied
        finally:
            t.stop()
            t.join(5)

    return asyncio.run(main()), events, started[0] - ended[0]


def test_the_hook_waits_for_the_gate() -> None:
    delay, events, _ = _run_gated(0.0005, gate_type=_PatientGate)
    assert events == ["call", "replied", "open", "published", "hook"]
    assert delay < 0.5


def test_a_gate_never_opened_holds_the_hook_for_the_bound_only() -> None:
    delay, events, after_call = _run_gated(None)
    assert events == ["call", "replied", "published", "hook"]
    # (negative control of the test above: it did wait; timed from the call's end on the MLX
    # thread, as a loop slow to see the reply would make the delay after it read short)
    assert HOLD_SECONDS * 0.9 < after_call and delay < 0.5


def test_a_short_call_does_not_hold_the_hook() -> None:
    """A call shorter than HOLD_MIN_CALL_SECONDS (a small model's step): the hook runs at once."""
    delay, events, _ = _run_gated(0.2, call_seconds=0.0)
    assert events.index("hook") < events.index("open") and delay < 0.15  # (the long call's hook waited for it)


def test_a_probe_after_a_gated_reply_sees_its_state() -> None:
    """The state is published after the reply; `published()` waits for it (here a slow publish)."""
    state = {"n": 0}

    def publish() -> None:
        time.sleep(0.03)
        state["n"] += 1

    async def main() -> tuple[bool, int, int]:
        t = MLXThread(4, after_reply=lambda: None, after_job=publish)
        try:
            gate = ReplyGate()
            await t.call(lambda: time.sleep(2 * HOLD_MIN_CALL_SECONDS), 5, gate)
            gate.open()
            pending, before = t.publishing, state["n"]
            await t.published(timeout=2)
            return pending, before, state["n"]
        finally:
            t.stop()
            t.join(5)

    assert asyncio.run(main()) == (True, 0, 1)


def test_an_ungated_call_is_published_before_its_reply() -> None:
    events: list[str] = []

    async def main() -> None:
        t = MLXThread(4, after_job=lambda: events.append("published"))
        try:
            await t.call(lambda: events.append("call"), 5)
            events.append("replied")
            assert not t.publishing
        finally:
            t.stop()
            t.join(5)

    asyncio.run(main())
    assert events == ["call", "published", "replied"]


def _lean_call(reply: Any) -> tuple[list[tuple[str, bool]], bool]:
    """One /rpc/ request through LeanApp with a stub handler; (message types sent with the gate's
    state at each, the gate's state after the loop ran its callbacks)."""
    seen: list[Any] = []

    async def rpc_reply(request: Any) -> Any:
        seen.append(request)
        if isinstance(reply, Exception):
            raise reply
        return reply

    app = LeanApp(rpc_reply, Instance())
    sent: list[tuple[str, bool]] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append((message["type"], seen[0].reply_gate.is_open))

    async def main() -> bool:
        scope = {"type": "http", "path": "/rpc/check_health", "method": "POST", "headers": [], "root_path": ""}
        await app(scope, receive, send)
        await asyncio.sleep(0)
        return seen[0].reply_gate.is_open

    return sent, asyncio.run(main())


def test_the_lean_path_opens_the_gate_after_the_reply() -> None:
    sent, after = _lean_call((200, {}, b"\x80", "application/msgpack"))
    assert sent == [("http.response.start", False), ("http.response.body", False)] and after


def test_the_lean_path_opens_the_gate_when_the_handler_fails() -> None:
    sent, after = _lean_call(RuntimeError("boom"))
    assert [s[0] for s in sent] == ["http.response.start", "http.response.body"] and after
