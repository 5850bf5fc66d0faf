"""The worker's `profile` call: cProfile of the MLX thread (every worker call runs there)."""

from __future__ import annotations

import cProfile
import logging
import os
import time

from sidecar.errors import StateError

log = logging.getLogger("sidecar.worker")


class Profiler:
    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None

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

        out = cache_home(home) / "profiles" / f"worker-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.prof"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._profile.dump_stats(str(out))
        self._profile = None
        log.info("profile written to %s", out)
        return str(out)
