"""The worker's `profile` call: cProfile of the MLX thread (every worker call runs there)."""

from __future__ import annotations

import cProfile
import logging
import os
import time

from sidecar.errors import StateError

log = logging.getLogger("sidecar.worker")


# Profiles kept in <home>/profiles (the oldest are deleted): a client calling profile start/stop
# in a loop must not fill the disk.
MAX_PROFILES = 16


class Profiler:
    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None
        self._written = 0

    def start(self) -> None:
        if self._profile is not None:
            raise StateError("a profile is already running; call profile(is_start=False) first")
        self._profile = cProfile.Profile()
        self._profile.enable()

    def stop(self, home: str | None) -> str:
        """Write `<home>/profiles/worker-<time>-<pid>.prof` and return its path."""
        if self._profile is None:
            raise StateError("no profile is running; call profile(is_start=True) first")
        self._profile.disable()
        from sidecar.models import cache_home

        self._written += 1
        out = cache_home(home) / "profiles" / f"worker-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._written}.prof"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._profile.dump_stats(str(out))
        self._profile = None
        _prune(out.parent, keep=out)
        log.info("profile written to %s", out)
        return str(out)


def _prune(folder, keep) -> None:
    """Delete all but the MAX_PROFILES newest profiles (never `keep`, the one just written)."""
    try:
        files = sorted(folder.glob("worker-*.prof"), key=lambda f: (f.stat().st_mtime_ns, _serial(f.name)))
    except OSError:
        return
    for f in files[:-MAX_PROFILES]:
        if f != keep:
            try:
                f.unlink()
            except OSError:
                pass


def _serial(name: str) -> int:
    """The write counter in `worker-<time>-<pid>-<n>.prof` (files of one clock tick sort by it)."""
    tail = name.removesuffix(".prof").rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0

