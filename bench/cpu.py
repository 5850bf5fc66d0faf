"""How much of the machine's CPU went to processes other than the bench and its servers.

The bench has two sides taking turns on a few cores: anything else running (another test suite,
a build) slows whichever side it overlaps and skews the ratios. Linux only (/proc); elsewhere the
figures are None.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Iterable

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / _TICK  # user nice system idle iowait irq softirq steal


def _proc_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0.0


def _own_seconds(live_pids: Iterable[int]) -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # children already waited for (stopped servers)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + sum(_proc_seconds(p) for p in live_pids)


class CpuMeter:
    """`mark(name)` closes a stage; `stages` maps each to the fraction of all cores used by others."""

    def __init__(self, pids: Iterable[int] | None = None):
        self.pids = pids  # a live view of the servers' pids
        self.cores = os.cpu_count() or 1
        self.stages: dict[str, float | None] = {}
        self._last = self._read()

    def _read(self) -> tuple[float, float | None, float]:
        return time.monotonic(), _busy_seconds(), _own_seconds(list(self.pids or ()))

    def mark(self, name: str) -> float | None:
        now = self._read()
        (t0, b0, o0), (t1, b1, o1) = self._last, now
        self._last = now
        if b0 is None or b1 is None or t1 <= t0:
            self.stages[name] = None
            return None
        foreign = max(0.0, (b1 - b0) - (o1 - o0)) / ((t1 - t0) * self.cores)
        self.stages[name] = min(1.0, foreign)
        return self.stages[name]
