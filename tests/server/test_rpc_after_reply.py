"""MLXThread's after-reply hook runs on the MLX thread after every call, once its reply is handed
over: a hook still running never holds the reply back, and a failing hook stops nothing."""

from __future__ import annotations

import asyncio
import threading

from sidecar.server.rpc import MLXThread


def test_the_reply_does_not_wait_for_the_hook() -> None:
    release = threading.Event()
    ran: list[str] = []

    def hook() -> None:
        ran.append(threading.current_thread().name)
        if len(ran) == 1:
            release.wait(10)  # the first reply must arrive while this still blocks

    async def main() -> list:
        t = MLXThread(4, after_reply=hook)
        first = await t.call(lambda: 1, timeout=5)
        release.set()
        second = await t.call(lambda: 2, timeout=5)
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
        t.stop()
        assert t.join(5)
        return got

    assert asyncio.run(main()) == [0, 1, 2]
    assert "the work after a reply failed" in caplog.text
