"""Allow-listed RPC dispatch and the one thread that owns every MLX call."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import threading
import time
from typing import Any, Callable

from sidecar.errors import ProtocolError, SidecarError, Unavailable
from sidecar.worker import ALLOWED, MLXWorker

# The allow-list: exactly the lifecycle methods of DESIGN §5, nothing else reachable by name.
METHODS = tuple(ALLOWED)


def bind_kwargs(worker: MLXWorker, method: str, kwargs: dict) -> Callable[[], Any]:
    """Check kwargs against the method's signature (400 naming the field) and return the call."""
    fn = getattr(worker, method)
    params = inspect.signature(fn).parameters
    for key in kwargs:
        if key not in params:
            raise ProtocolError(f"{method} takes no argument {key!r} (takes: {', '.join(params) or 'none'})", field=key)
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in kwargs:
            raise ProtocolError(f"{method} needs argument {name!r}", field=name)
    return lambda: to_wire(fn(**kwargs))


def to_wire(value: Any) -> Any:
    if hasattr(value, "to_wire"):
        return value.to_wire()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclasses.dataclass
class _Job:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None
    cancelled: bool = False


class MLXThread:
    """One thread runs every MLX call, in arrival order; a bounded queue in front of it."""

    def __init__(self, max_queue: int):
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="mlx", daemon=True)
        self.busy_since: float | None = None
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:
                continue
            self.busy_since = time.monotonic()
            try:
                result, error = job.fn(), None
            except BaseException as e:  # delivered to the awaiting handler, never kills the thread
                result, error = None, e
            finally:
                self.busy_since = None
            if job.future is not None:
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)

    async def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run fn on the MLX thread. A call still queued after `timeout` is dropped (503); once
        started it runs to the end, since abandoning a step would desynchronise the scheduler."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Unavailable("the worker's queue is full", retry_after=1) from None
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except asyncio.TimeoutError:
            if not self._cancel_if_queued(job):
                return await job.future
            raise Unavailable(f"the call waited {timeout:g}s for the worker and was dropped", retry_after=1) from None

    def submit(self, fn: Callable[[], Any]) -> None:
        """Fire and forget (start-up preload); fn reports its own errors."""
        self._queue.put_nowait(_Job(fn, asyncio.get_running_loop(), None))

    def _cancel_if_queued(self, job: _Job) -> bool:
        # Under the queue's own lock, so the thread cannot take the job between check and mark.
        with self._queue.mutex:
            if job in self._queue.queue:
                job.cancelled = True
                return True
        return False

    def depth(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def error_status(e: BaseException) -> int:
    return e.status if isinstance(e, SidecarError) else 500
