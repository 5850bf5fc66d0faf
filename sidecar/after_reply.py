"""Work that may wait until the current call's reply is on its way: `after_reply(fn)`.

On MLX's CPU backend `mx.async_eval` returns only once most of the graph has run (it bounds the
tasks in flight), so queueing the next decode step's forward ahead (runner/model_runner.py)
before the reply is sent made the reply wait for that whole forward. Work handed to
`after_reply` instead runs on the same thread right after the reply has been handed back to the
event loop (server/rpc.py, MLXThread), and before the thread's next call: the forward then
overlaps the round trip, as it does on a GPU. Outside the MLX thread (in-process use, tests,
scale-out ranks) there is no reply to wait for, and `fn` runs at once. No MLX.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("sidecar.rpc")
_local = threading.local()


def after_reply(fn: Callable[[], object]) -> None:
    pending = getattr(_local, "pending", None)
    if pending is None:
        fn()
    else:
        pending.append(fn)


def collect() -> None:
    """On this thread, `after_reply` work is kept from now until `run_pending`."""
    _local.pending = []


def run_pending() -> None:
    """Run what was kept, in order; a failure is logged (the next call that needs the result
    meets it again) and never stops the thread."""
    pending, _local.pending = getattr(_local, "pending", None) or [], None
    for fn in pending:
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.exception("deferred work after a reply failed")
