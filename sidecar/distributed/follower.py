"""Ranks 1..N-1: no HTTP; receive rank 0's calls over the group and run each in lockstep.

A follower only ever sees calls rank 0 validated (or ran) first, so it runs them as sent; an error
here is the same one rank 0 met (both ran a FIRST call), logged and passed over. Losing rank 0
(a failed collective, or no message within rank_timeout plus two heartbeats) exits non-zero, so the
service manager restarts this rank and the group forms again.
"""

from __future__ import annotations

import logging

from sidecar.distributed.group import GroupLost, Watchdog, exit_soon, is_group_error
from sidecar.distributed.leader import deadline
from sidecar.distributed.shard import GroupWorker
from sidecar.errors import SidecarError

log = logging.getLogger("sidecar.distributed")


def follow(worker: GroupWorker) -> int:
    """Serve rank 0 until it says exit (0) or is lost (1)."""
    ch, cfg = worker.channel, worker.config
    idle = cfg.rank_timeout + 2 * cfg.heartbeat_interval

    def lost(seconds: float, what: str) -> None:
        log.error("rank %d: rank 0 lost (no %s within %.1fs); exiting", ch.rank, what, seconds)
        exit_soon(1, 0.0)

    watchdog = Watchdog(lost)
    log.info("rank %d/%d: following rank 0", ch.rank, ch.size)
    while True:
        try:
            with watchdog.watch(idle, "message from rank 0"):
                msg = ch.recv()
            method = msg.get("m")
            if method == "__ping__":
                continue
            if method == "__exit__":
                log.info("rank %d: rank 0 asked the group to exit", ch.rank)
                return 0
            log.debug("rank %d: %s", ch.rank, method)
            with watchdog.watch(deadline(cfg, method), method):
                try:
                    getattr(worker, method)(**msg.get("k", {}))
                except SidecarError as e:
                    log.warning("rank %d: %s failed as on rank 0: %s", ch.rank, method, e)
        except Exception as e:
            if not is_group_error(e):
                raise
            log.error("rank %d: the group failed (%s); exiting", ch.rank, e)
            return 1
