"""Ranks 1..N-1: no HTTP; receive rank 0's calls over the group and run each in lockstep.

When rank 0 stops (even cleanly) a follower exits 75 (EX_TEMPFAIL), never 0: the service
manager restarts it, and it waits in mx.distributed.init for rank 0 to form the group again.

A follower only ever sees calls rank 0 validated (or ran) first, so it runs them as sent; an error
here is the same one rank 0 met (both ran a FIRST call), logged and passed over. Losing rank 0
(a failed collective, or no message within rank_timeout plus two heartbeats) exits non-zero, so the
service manager restarts this rank and the group forms again.
"""

from __future__ import annotations

import logging

from sidecar.distributed.group import Watchdog, exit_soon, is_group_error
from sidecar.distributed.leader import deadline
from sidecar.distributed.shard import GroupWorker
from sidecar.errors import SidecarError

log = logging.getLogger("sidecar.distributed")


REJOIN = 75  # rank 0 stopped: restart to rejoin (launchd KeepAlive / systemd Restart=on-failure)


def follow(worker: GroupWorker) -> int:
    """Serve rank 0 until it stops (REJOIN) or is lost (1)."""
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
                log.info("rank %d: rank 0 stopped; exiting %d so the service manager restarts this rank", ch.rank, REJOIN)
                return REJOIN
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
