"""MLXThread's after-reply hook runs on the MLX thread after every call, once its reply is handed
over: a hook still running never holds the reply back, and a failing hook stops nothing."""

from __future__ import annotations

import asyncio
import threading

from sidecar.server.rpc import MLXThread


def test_the_reply_does_not_wait_for_the_hook() -> None:
    release = threading.Event()
    ran: list[str] = []

    once, twice = threading.Event(), threading.Event()

    def hook() -> None:
        ran.append(threading.current_thread().name)
        if len(ran) == 1:
            once.set()
            release.wait(10)  # the first reply must arrive while this still blocks
        else:
            twice.set()

    async def main() -> list:
        t = MLXThread(4, after_reply=hook)
        first = await t.call(lambda: 1, timeout=5)
        assert await asyncio.to_thread(once.wait, 5)  # (a call queued before the hook starts would skip it)
        release.set()
        second = await t.call(lambda: 2, timeout=5)
        assert await asyncio.to_thread(twice.wait, 5)
        t.stop()
        assert t.join(5)
        return [first, second]

    assert asyncio.run(asyncio.wait_for(main(), 8)) == [1, 2]
    assert ran == ["mlx", "mlx"]


def test_a_failing_hook_stops_nothing(caplog) -> None:
    def hook() -> None:
        raise RuntimeError("boom")

    async def main() -> list:
        t = MLXThread(4, after_reply=hook)
        got = [await t.call(lambda: i, timeout=5) for i in range(3)]
        await asyncio.sleep(0.05)  # the last hook runs (and fails) after the last reply
        t.stop()
        assert t.join(5)
        return got

    assert asyncio.run(main()) == [0, 1, 2]
    assert "the work after a reply failed" in caplog.text


def test_the_hook_runs_after_each_call_also_with_one_queued() -> None:
    """A call already waiting starts after the hook: the forward it most likely uses is dispatched
    first (its decode and plan then run while that forward's last ops compute)."""
    gate = threading.Event()
    seen: list[int] = []

    async def main() -> list:
        t = MLXThread(4, after_reply=lambda: seen.append(t.depth()))
        first = asyncio.ensure_future(t.call(lambda: gate.wait(5), timeout=5))
        while not t.busy:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(t.call(lambda: 2, timeout=5))
        while t.depth() != 1:
            await asyncio.sleep(0.001)
        gate.set()
        got = [await first, await second]
        t.stop()
        assert t.join(5)
        return got

    assert asyncio.run(main()) == [True, 2]
    assert seen == [1, 0]  # after the first call (the second queued), then after the second
