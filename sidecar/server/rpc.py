"""Allow-listed RPC dispatch and the one thread that owns every MLX call."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping

from sidecar.errors import ProtocolError, SidecarError, Unavailable
from sidecar.wire.steps import RESETS, STEP_METHODS, StepLedger, step_id_of
from sidecar.worker.mlx_worker import ALLOWED, MLXWorker

log = logging.getLogger("sidecar.rpc")

# The allow-list: exactly the lifecycle methods of docs/architecture.md, The worker lifecycle, nothing else reachable by name.
METHODS = tuple(ALLOWED)


def bind_kwargs(worker: MLXWorker, method: str, kwargs: dict, steps: StepLedger | None = None,
                body: bytes = b"") -> Callable[[], Any]:
    """Check kwargs against the method's signature (400 naming the field) and return the call.
    A null argument means the parameter's default. With `steps`, step methods take an optional
    `step_id` (exactly-once retries, see wire/steps.py); `body` is the call's, which a resend must repeat."""
    fn = getattr(worker, method)
    params = _parameters(fn)
    step_id = step_id_of(kwargs, method) if steps is not None else None
    for key in [k for k, v in kwargs.items() if v is None and k in params]:
        if params[key].default is not inspect.Parameter.empty:
            del kwargs[key]
    for key in kwargs:
        if key not in params:
            raise ProtocolError(f"{method} takes no argument {key!r} (takes: {', '.join(params) or 'none'})", field=key)
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in kwargs:
            raise ProtocolError(f"{method} needs argument {name!r}", field=name)
    if steps is None:
        return lambda: to_wire(fn(**kwargs))
    if method in STEP_METHODS:
        return lambda: steps.run(step_id, method, lambda: to_wire(fn(**kwargs)), body)

    def call() -> Any:
        result = to_wire(fn(**kwargs))
        if method in RESETS:
            steps.reset()  # the request state the kept replies describe is gone
        return result

    return call


# inspect.signature costs ~0.1 ms a call, as much as the rest of a decode step's dispatch: kept
# per underlying function (bound methods are fresh objects on every getattr).
_PARAMS: dict[Any, Mapping[str, inspect.Parameter]] = {}


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    key = (getattr(fn, "__func__", fn), getattr(fn, "__self__", None) is not None)
    params = _PARAMS.get(key)
    if params is None:
        params = _PARAMS[key] = inspect.signature(fn).parameters
    return params


def to_wire(value: Any) -> Any:
    if hasattr(value, "to_wire"):
        return value.to_wire()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclasses.dataclass(eq=False)  # identity: a job is found in the queue by `is`, never by value
class _Job:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future | None
    cancelled: bool = False


class MLXThread:
    """One thread runs every MLX call, in arrival order, behind a bounded queue.

    `call` and `submit` are used from the event loop thread only, so the bound needs no lock of its
    own. The thread publishes the worker's state after every job through `after_job`, and runs
    `after_reply` once the job's result is handed to the event loop (the reply need not wait for it).
    """

    def __init__(self, max_queue: int, after_job: Callable[[], None] | None = None,
                 after_reply: Callable[[], None] | None = None):
        self.max_queue = max_queue
        self._after_job = after_job
        self._after_reply = after_reply  # work that may wait until the reply is handed over
        self._queue: queue.Queue[_Job | None] = queue.Queue()  # bounded by `call`; the stop sentinel always fits
        self._stopping = False
        self.busy_since: float | None = None  # monotonic start of the running job, None when idle
        self._running: _Job | None = None
        # Waiting for a call (during a decode stream: the round trips it did not overlap): the
        # finished waits, and when the current one began (None while a job runs); one tuple, so
        # another thread reads a consistent pair.
        self._idle: tuple[float, float | None] = (0.0, None)
        self._thread = threading.Thread(target=self._loop, name="mlx", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self._run_jobs()
        finally:
            # MLX (>= 0.32) frees a thread's streams only when told to, before the thread ends;
            # left to process exit, its destructors can abort ("terminate called ...", SIGABRT).
            import mlx.core as mx

            mx.clear_streams()

    def _get(self) -> _Job | None:
        self._idle = (self._idle[0], time.perf_counter())
        job = self._queue.get()
        total, since = self._idle
        self._idle = (total + time.perf_counter() - (since or 0.0), None)
        return job

    @property
    def idle_seconds(self) -> float:
        """Time the thread has waited for calls, the wait going on now included."""
        total, since = self._idle
        return total + (time.perf_counter() - since if since is not None else 0.0)

    def _run_jobs(self) -> None:
        while (job := self._get()) is not None:
            if job.cancelled:
                continue
            self.busy_since, self._running = time.monotonic(), job
            try:
                result, error = job.fn(), None
            except BaseException as e:  # delivered to the awaiting handler, never kills the thread
                result, error = None, e
            finally:
                self.busy_since, self._running = None, None
            # Published before the reply is handed over: a probe read after a reply sees its effects.
            self._hook(self._after_job)
            if job.future is not None and job.loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                    job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            self._hook(self._after_reply)

    @staticmethod
    def _hook(fn: Callable[[], None] | None) -> None:
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a hook must never stop the worker
                log.exception("the MLX thread's %s failed", getattr(fn, "__name__", "hook"))

    async def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run fn on the MLX thread. A call still queued after `timeout` is dropped (503); once
        started it runs to the end, since abandoning a step would desynchronise the scheduler.
        If the awaiting task is cancelled while the job is still queued, the job never runs."""
        if self._stopping:
            raise Unavailable("the worker is shutting down", retry_after=5)
        if self.depth() >= self.max_queue:
            raise Unavailable(f"the worker's queue is full ({self.max_queue} calls waiting)", retry_after=1)
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future())
        self._queue.put_nowait(job)
        # A timer instead of wait_for(shield(...)): no extra task or future per call.
        timer = loop.call_later(timeout, self._expire, job, timeout)
        try:
            return await job.future  # type: ignore[misc]
        except asyncio.CancelledError:
            self._cancel_if_queued(job)
            raise
        finally:
            timer.cancel()

    def _expire(self, job: _Job, timeout: float) -> None:
        """On the event loop, `timeout` after the call was queued: drop it if it has not started."""
        if self._cancel_if_queued(job) and job.future is not None:
            _settle(job.future, None, Unavailable(f"the call waited {timeout:g}s for the worker and was dropped",
                                                  retry_after=1))

    def fail_running(self, error: BaseException) -> None:
        """Answer the running call with `error` now, from any thread: for a job that can never
        finish (a collective whose peer is gone, see sidecar/distributed). Its late result is dropped."""
        job = self._running
        if job is not None and job.future is not None and job.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                job.loop.call_soon_threadsafe(_settle, job.future, None, error)

    def submit(self, fn: Callable[[], Any]) -> None:
        """Fire and forget (start-up preload); fn reports its own errors."""
        self._queue.put_nowait(_Job(fn, None, None))

    def _cancel_if_queued(self, job: _Job) -> bool:
        # Under the queue's own lock, so the thread cannot take the job between check and mark.
        with self._queue.mutex:
            if any(j is job for j in self._queue.queue):
                job.cancelled = True
                return True
        return False

    def cancel_queued(self, message: str) -> int:
        """Drop every call that has not started; each gets 503 (it never ran). Returns how many."""
        with self._queue.mutex:
            jobs = [j for j in self._queue.queue if j is not None and not j.cancelled]
            for j in jobs:
                j.cancelled = True
        for j in jobs:
            if j.future is not None and j.loop is not None:
                j.loop.call_soon_threadsafe(_settle, j.future, None, Unavailable(message, retry_after=5))
        return len(jobs)

    def depth(self) -> int:
        """Calls waiting to run (a dropped call still in the queue is not one)."""
        with self._queue.mutex:
            return sum(1 for j in self._queue.queue if j is not None and not j.cancelled)

    @property
    def busy(self) -> bool:
        return self.busy_since is not None

    def stop(self) -> None:
        """Ask the thread to exit after the jobs already queued; never blocks."""
        self._stopping = True
        self._queue.put_nowait(None)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to exit; True when it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def error_status(e: BaseException) -> int:
    return e.status if isinstance(e, SidecarError) else 500
