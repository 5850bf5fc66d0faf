"""Device idle time per decode step: how much of each step period no MLX compute was queued or running.

On MLX's CPU backend every thread that evaluates arrays gets a stream run by a thread of MLX's own
(created at that thread's first evaluation); it computes every op of every forward the server
runs, and while it sleeps nothing is queued for the device. So its busy time (on a core, from its
thread CPU clock, exact; plus the time it waited runnable for one, from schedstat) against wall
time is the device's idle time. The MLX thread reads both each time a call's reply is handed over
(`mark`), and a decode step's period (previous reply handed over -> its own) adds its idle time to
its batch size's total. `MLXThread.idle_seconds` is only a proxy: the MLX thread can wait while
the device computes, and the device can idle while the MLX thread builds a graph or waits to
dispatch. Off the CPU backend (Metal, CUDA) or without /proc nothing is measured (`totals` None).

Every START_EVERY-th call also reads the clocks as it starts on the MLX thread (`started`), which
splits that step's period in two: the round trip (previous reply handed over -> this call starts:
the reply's write and travel, the scheduler, the call's parse and queueing) and the step itself.
The round trip's idle is what the RPC overhead leaves the device idle; sampled, as the reading
(~10 us) sits on the call's path.

(The thread's schedstat run time alone would not do: it is updated at scheduler ticks, 4 ms here.)
"""

from __future__ import annotations

import os
import time

_TASKS = "/proc/self/task"
START_EVERY = 8


def _tids() -> set[int]:
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:  # no /proc (macOS)
        return set()


def _cpu_clock(tid: int) -> int:
    """The clock id of thread `tid`'s CPU time (Linux: CPUCLOCK_SCHED of a thread, same process)."""
    return (~tid << 3) | 6


def discover_stream_threads() -> list[int]:
    """Call on the MLX thread before its first evaluation: evaluates a small array and returns the
    threads that appeared and ran meanwhile (its stream's); [] off the CPU backend or without /proc."""
    import mlx.core as mx

    before = _tids()
    if not before or mx.default_device() != mx.cpu:
        return []
    mx.eval(mx.arange(1 << 16).sum())
    found = []
    for tid in sorted(_tids() - before):
        try:
            if time.clock_gettime(_cpu_clock(tid)) > 0:
                found.append(tid)
        except OSError:  # gone already
            pass
    return found


class DeviceIdle:
    """Per decode batch size: the device's idle seconds and the steps they were measured over.
    `mark` runs on the MLX thread only; `totals` may be read from any thread (one dict swap)."""

    def __init__(self, tids: list[int]):
        self._clocks = [_cpu_clock(t) for t in tids]
        self._fds = []
        for t in tids:
            try:
                self._fds.append(os.open(f"{_TASKS}/{t}/schedstat", os.O_RDONLY))
            except OSError:
                pass
        self.tids = list(tids)
        self._last: tuple[float, float] | None = None  # (wall, busy) at the previous step's reply
        self._start: tuple[float, float] | None = None  # (wall, busy) as this call started (sampled)
        self._calls = 0
        self._totals: dict[int, tuple[float, int, float, int]] = {}  # rows -> idle, steps, of it in round trips, those

    @property
    def enabled(self) -> bool:
        return bool(self._clocks)

    def busy(self) -> float:
        """Seconds the stream threads ran or waited runnable (the wait is exact up to a wait going on)."""
        total = 0.0
        for clk in self._clocks:
            total += time.clock_gettime(clk)
        for fd in self._fds:
            total += int(os.pread(fd, 64, 0).split()[1]) / 1e9
        return total

    def started(self) -> None:
        """A call starts on the MLX thread (every START_EVERY-th reads the clocks)."""
        self._calls += 1
        if self._clocks and self._calls % START_EVERY == 0:
            try:
                self._start = (time.perf_counter(), self.busy())
            except (OSError, ValueError, IndexError):
                self._start = None

    def mark(self, decode_rows: int | None, step: bool) -> None:
        """A call's reply was handed over. `step`: it was an execute_model/sample_tokens call (the
        next step's period starts here); `decode_rows`: it was a decode step of that many rows (its
        period, since the previous step's reply, is counted)."""
        start, self._start = self._start, None
        if not self._clocks:
            return
        if not step:
            self._last = None  # a step after another call: its period is not a decode stream's
            return
        try:
            now, busy = time.perf_counter(), self.busy()
        except (OSError, ValueError, IndexError):  # the thread is gone
            self._clocks, self._last = [], None
            return
        last, self._last = self._last, (now, busy)
        if decode_rows and last is not None:
            # Not clamped per step: a runnable wait still going on at a reading is counted at the
            # next one, so that step's idle reads high by it and the next one's low (below zero).
            idle = (now - last[0]) - (busy - last[1])
            seconds, steps, rt, rt_steps = self._totals.get(decode_rows, (0.0, 0, 0.0, 0))
            if start is not None and start[0] > last[0]:
                rt, rt_steps = rt + (start[0] - last[0]) - (start[1] - last[1]), rt_steps + 1
            totals = dict(self._totals)
            totals[decode_rows] = (seconds + idle, steps + 1, rt, rt_steps)
            self._totals = totals

    @property
    def totals(self) -> dict[str, dict[str, float]] | None:
        """{rows: {"seconds": idle, "steps": n, "round_trip_seconds": of it in the round trips of
        "round_trip_steps" (sampled) steps}} for /info; None when not measurable here."""
        if not self._clocks:
            return None
        return {str(k): {"seconds": max(0.0, s), "steps": n, "round_trip_seconds": max(0.0, rt),
                         "round_trip_steps": rn} for k, (s, n, rt, rn) in sorted(self._totals.items())}
