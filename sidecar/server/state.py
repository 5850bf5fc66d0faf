"""The server's state, shared by the routes (app.py) and the shutdown (shutdown.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from sidecar.config import Config
from sidecar.server.instance import Instance
from sidecar.server.metrics import Metrics
from sidecar.server.rpc import MLXThread
from sidecar.server.sequencer import StepSequencer
from sidecar.server.startup import Startup
from sidecar.wire.steps import StepLedger
from sidecar.worker.mlx_worker import MLXWorker

slog = logging.getLogger("sidecar.server")


@dataclass
class Sidecar:
    config: Config
    worker: MLXWorker
    metrics: Metrics
    token: str | None
    thread: MLXThread | None = None
    loop: asyncio.AbstractEventLoop | None = None
    draining: bool = False
    deadline: float | None = None  # monotonic time by which shutdown must be complete
    clean_shutdown: bool = True
    preload_error: str | None = field(default=None)
    startup: Startup = field(default_factory=Startup)  # the preload's running stage, if any
    instance: Instance = field(default_factory=Instance)
    # two kept: with two steps in flight (pipelined), a lost reply of the older one can still be resent
    steps: StepLedger = field(default_factory=lambda: StepLedger(window=2))
    sequencer: StepSequencer = field(default_factory=StepSequencer)  # two steps in flight over two connections
    _dropped_queued: bool = False

    def publish(self) -> None:
        self.metrics.publish(self.worker)

    def after_reply(self) -> None:
        """The step's decode-ahead forward, queued once its reply is on its way (engine/overlap.py)."""
        runner = self.worker.runner
        if runner is not None:
            runner.overlap.flush()

    def begin_drain(self) -> None:
        """Stop taking RPCs (503) and drop calls that have not started. Safe in a signal handler:
        it only sets flags and schedules the rest on the event loop."""
        if self.draining:
            return
        self.draining = True
        self.deadline = time.monotonic() + self.config.shutdown_timeout
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.loop.call_soon_threadsafe(self.drop_queued)

    def drop_queued(self) -> None:
        """Once per shutdown, on the event loop: queued calls get 503 (they never ran)."""
        if not self._dropped_queued and self.thread is not None:
            self._dropped_queued = True
            self.thread.cancel_queued("the worker is shutting down")

    def cut_off(self, request_id: str | None = None) -> None:
        """The shutdown timeout ran out with a call still running: its outcome is unknown, so the
        exit is unclean (status 1), whether or not the call ends before the process does."""
        if self.clean_shutdown:
            self.clean_shutdown = False
            slog.error("shutdown: a call was still running after the %gs shutdown timeout", self.config.shutdown_timeout,
                       extra={"request_id": request_id} if request_id else None)
