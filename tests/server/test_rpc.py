"""MLXThread (server/rpc.py): the thread counts the time it waits for calls, and dropped calls do
not hold places in the queue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sidecar.errors import Unavailable
from sidecar.server.rpc import MLXThread


def test_a_dropped_call_frees_its_place_in_the_queue() -> None:
    """max_queue 1: a call queued behind a long one times out (503, never runs); the next call is
    queued (not refused as "queue full") although the dropped one is still in the queue."""
    release = threading.Event()
    ran: list[str] = []

    async def main() -> tuple[int, str]:
        t = MLXThread(max_queue=1)
        try:
            first = asyncio.ensure_future(t.call(lambda: release.wait(5), 10))
            while not t.busy:
                await asyncio.sleep(0.005)
            with pytest.raises(Unavailable, match="waited 0.05s"):
                await t.call(lambda: ran.append("dropped"), 0.05)
            depth = t.depth()
            nxt = asyncio.ensure_future(t.call(lambda: ran.append("next") or "ok", 10))
            await asyncio.sleep(0.02)
            with pytest.raises(Unavailable, match="queue is full"):  # this one does hold the place
                await t.call(lambda: None, 10)
            release.set()
            await first
            return depth, await nxt
        finally:
            t.stop()
            t.join(5)

    assert asyncio.run(main()) == (0, "ok")
    assert ran == ["next"]


def test_the_thread_counts_the_time_it_waits_for_calls() -> None:
    async def main() -> tuple[float, float]:
        t = MLXThread(max_queue=4)
        try:
            await t.call(lambda: None, 5)
            before = t.idle_seconds
            await asyncio.sleep(0.1)  # nothing to do
            await t.call(lambda: time.sleep(0.3), 5)  # busy: not idle
            mid = t.idle_seconds
            await t.call(lambda: None, 5)
            return mid - before, t.idle_seconds - mid
        finally:
            t.stop()
            t.join(5)

    waited, busy = asyncio.run(main())
    assert 0.09 < waited < 0.29 and busy < 0.2  # the 0.3 s call is not in it


def test_the_idle_time_includes_the_wait_going_on() -> None:
    """Read while the thread waits (as /info is, between a client's calls), the idle time already
    counts that wait, so a delta over a run never takes in the wait before it."""
    async def main() -> tuple[float, float]:
        t = MLXThread(max_queue=4)
        try:
            await t.call(lambda: None, 5)
            a = t.idle_seconds
            await asyncio.sleep(0.1)
            b = t.idle_seconds  # no call in between
            return a, b
        finally:
            t.stop()
            t.join(5)

    a, b = asyncio.run(main())
    assert 0.09 < b - a < 1.0


def test_after_reply_runs_once_the_result_is_handed_over() -> None:
    """The hook (the decode-ahead forward, engine/overlap.py) may not delay the reply: here it
    waits for the awaiting side to have the result, which it could never have if the hook ran
    first; the next call still runs after the hook."""
    got_reply = threading.Event()
    order: list[str] = []

    def after_reply() -> None:
        if order:  # (the first call only)
            return
        order.append("hook waits" if got_reply.wait(5) else "hook timed out")

    async def main() -> str:
        t = MLXThread(max_queue=4, after_reply=after_reply)
        try:
            result = await t.call(lambda: "step", 10)
            got_reply.set()
            await t.call(lambda: order.append("next call"), 10)
            return result
        finally:
            t.stop()
            t.join(5)

    assert asyncio.run(main()) == "step"
    assert order == ["hook waits", "next call"]
