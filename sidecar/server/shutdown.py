"""Shutdown after SIGTERM: new calls get 503 while the running one finishes, then the worker
frees its MLX memory on the MLX thread, all within the shutdown deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import mlx.core as mx

from sidecar.errors import Unavailable
from sidecar.server.state import Sidecar

slog = logging.getLogger("sidecar.server")


async def exit_when_idle(sc: Sidecar, server: Any) -> None:
    """After SIGTERM: tell uvicorn to stop once no call runs (or the shutdown deadline passed)."""
    thread = sc.thread
    while (thread is not None and (thread.busy or thread.depth()) and not server.should_exit
           and time.monotonic() < (sc.deadline or 0)):
        await asyncio.sleep(0.02)
    # uvicorn's own wait for open connections gets only what is left of the deadline.
    server.config.timeout_graceful_shutdown = max(0.1, (sc.deadline or 0) - time.monotonic())
    server.should_exit = True


async def drain(sc: Sidecar) -> None:
    """Shutdown, bounded by `sc.deadline`: wait for the running call, free MLX memory on the MLX
    thread (worker.shutdown), stop the thread. Sets `sc.clean_shutdown` False when time ran out."""
    thread = sc.thread
    if thread is None:
        return

    def remaining() -> float:
        return max(0.5, (sc.deadline or time.monotonic()) - time.monotonic())

    sc.drop_queued()  # now, so that the scheduled drop cannot hit the worker.shutdown queued below
    slog.info("shutting down: waiting up to %.3gs for the running call", remaining())
    try:
        budget = remaining()
        await asyncio.wait_for(thread.call(sc.worker.shutdown, budget), budget)
        slog.info("shutdown: worker freed, MLX active memory %d bytes", mx.get_active_memory())
    except (asyncio.TimeoutError, Unavailable):
        sc.cut_off()
    except Exception:  # noqa: BLE001 - still stop the thread
        sc.clean_shutdown = False
        slog.exception("shutdown: freeing the worker failed")
    thread.stop()
    if not await asyncio.get_running_loop().run_in_executor(None, thread.join, remaining()):
        sc.clean_shutdown = False
