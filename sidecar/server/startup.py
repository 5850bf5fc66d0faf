"""`serve --preload`: bring the worker to `ready` at start-up, one named stage at a time.

While it runs, `Startup.stage` names what it is doing ("loading the model", ...); the app answers
every RPC from others with 503 + Retry-After naming that stage (a scheduler racing the preload
would otherwise get 409s from a state machine moving under it), and `/readyz` and `/info` report
it. Each finished stage is reported with its duration: on a terminal as a plain progress line,
through the `sidecar.server` logger at level info otherwise (quiet at the default level).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from sidecar.worker.mlx_worker import MLXWorker

slog = logging.getLogger("sidecar.server")
READY = "ready"  # reported once at the end, with the total


@dataclass
class Startup:
    """What the preload is doing now (None when it is not running) and how long each stage took.

    `report(stage, None)` is called when a stage begins, `report(stage, seconds)` when it ends,
    `report(stage, nan)` when it failed; preload ends with `report(READY, total seconds)`."""

    stage: str | None = None
    done: list[tuple[str, float]] = field(default_factory=list)
    report: Callable[[str, float | None], None] | None = None
    _t0: float | None = None  # None: `stage` is only announced (queued), not running

    def begin(self, stage: str) -> None:
        # The next stage replaces the last one at once: /readyz never sees None in between (the
        # report below writes, and lets other threads run).
        closed = self._close()
        self.stage, self._t0 = stage, time.perf_counter()
        self._report(closed)
        if self.report is not None:
            self.report(stage, None)

    def end(self) -> None:
        """Close the running stage (if any) and report it with its duration."""
        closed = self._close()
        if closed is not None:
            self.stage = self._t0 = None
        self._report(closed)

    def _close(self) -> tuple[str, float] | None:
        if self.stage is None or self._t0 is None:
            return None
        closed = (self.stage, time.perf_counter() - self._t0)
        self.done.append(closed)
        return closed

    def _report(self, closed: tuple[str, float] | None) -> None:
        if closed is not None and self.report is not None:
            self.report(*closed)


def progress_reporter(stream: TextIO | None = None) -> Callable[[str, float | None], None]:
    """Show stages on a terminal ("mlx-sidecar: warming up ... 12.34s"); with info logs on (any
    stream), one log record per finished stage instead; nothing otherwise."""
    out = stream if stream is not None else sys.stderr

    def report(stage: str, seconds: float | None) -> None:
        if slog.isEnabledFor(logging.INFO):
            if seconds is not None and not math.isnan(seconds) and stage != READY:  # (preload logs its own)
                slog.info("preload: %s took %.2fs", stage, seconds, extra={"stage": stage, "seconds": round(seconds, 3)})
        elif out.isatty():
            if seconds is None:
                out.write(f"mlx-sidecar: {stage} ...")
            elif stage == READY:
                out.write(f"mlx-sidecar: ready in {seconds:.2f}s\n")
            else:
                out.write(" failed\n" if math.isnan(seconds) else f" {seconds:.2f}s\n")
            out.flush()

    return report


def model_stage(worker: MLXWorker) -> str:
    """The load stage's name: first use of a built-in also generates (or converts) it."""
    from sidecar.models import needs_building

    name = worker.config.model
    return f"building {name} (first use) and loading the model" if needs_building(name, worker.config.home) \
        else "loading the model"


def preload(worker: MLXWorker, after_each: Any = None, startup: Startup | None = None) -> None:
    """Drive the lifecycle to `ready` with a pool sized for max_num_seqs full-length requests."""
    cfg = worker.config
    step = after_each or (lambda: None)
    st = startup or Startup()
    try:
        st.begin("initialising the device")
        worker.init_device()
        step()
        st.begin(model_stage(worker))
        worker.load_model()
        step()
        st.begin("measuring memory")
        free = worker.determine_available_memory()
        per_block = worker.get_cache_block_size_bytes()
        assert worker.runner is not None
        want = -(-worker.runner.max_model_len // cfg.block_size) * cfg.max_num_seqs
        st.begin("allocating the cache")
        worker.initialize_cache(max(1, min(free // per_block, want)), 0)
        step()
        st.begin("warming up")
        worker.compile_or_warm_up_model()
        worker.check_health()
        st.end()
    finally:
        if st.stage is not None and st._t0 is not None and st.report is not None:
            st.report(st.stage, math.nan)  # failed: not in `done`
        st.stage = st._t0 = None  # the lifecycle is open again
    total = sum(s for _, s in st.done)
    if st.report is not None:
        st.report(READY, total)
    slog.info("preload: ready with %d KV blocks in %.2fs", worker.runner.num_blocks if worker.runner else 0, total)
