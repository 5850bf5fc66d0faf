"""How long the sidecar's MLX thread waits for a call while a benchmark's traffic runs.

Under vLLM that bounds the device's idle time from above: every forward is started on that
thread, and while it waits for a call only the decode queued ahead may still be computing. A probe
samples the server's counters (`mlx_worker_mlx_thread_idle_seconds_total`,
`mlx_worker_steps_total`) every `period` seconds in a thread of its own; `idle_share` keeps only
the stretch where steps ran (the client's own start-up and its pauses before the first step and
after the last are not the device's to count). A scrape costs the sidecar about a millisecond of
CPU: every 0.1 s, about 1% of a core.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Sequence

IDLE, STEPS = "mlx_worker_mlx_thread_idle_seconds_total", "mlx_worker_steps_total"


@dataclass(frozen=True)
class Sample:
    t: float  # monotonic seconds
    idle: float  # the MLX thread's idle seconds since the server started
    steps: float  # execute_model calls that ran a forward, since the server started


def parse(metrics: str) -> tuple[float, float] | None:
    """(idle seconds, steps) from a Prometheus text exposition; None when either is missing."""
    got: dict[str, float] = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in (IDLE, STEPS):
            got[name] = float(value)
    return (got[IDLE], got[STEPS]) if len(got) == 2 else None


def idle_share(samples: Sequence[Sample]) -> tuple[float, int] | None:
    """(idle share of the wall time, steps) between the first sample taken once steps had begun
    and the last taken before they ended: a window inside the traffic, at most one period short
    of it at each end. None when fewer than two samples fall in it."""
    if len(samples) < 2:
        return None
    first, last = samples[0].steps, samples[-1].steps
    inside = [s for s in samples if first < s.steps < last]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        return None
    a, b = inside[0], inside[-1]
    return (b.idle - a.idle) / (b.t - a.t), int(b.steps - a.steps)


class IdleProbe:
    """Samples `url`/metrics every `period` seconds between `start()` and `stop()`."""

    def __init__(self, url: str, period: float = 0.1):
        self.url, self.period = url.rstrip("/"), period
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-probe", daemon=True)

    def _sample(self) -> None:
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                got = parse(r.read().decode())
        except OSError:  # (a busy or restarting server: the window simply has fewer samples)
            return
        if got is not None:
            self.samples.append(Sample(time.monotonic(), *got))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def start(self) -> IdleProbe:
        self._sample()  # the counters before any traffic
        self._thread.start()
        return self

    def stop(self) -> tuple[float, int] | None:
        self._stop.set()
        self._thread.join()
        self._sample()
        return idle_share(self.samples)
