"""The reply gate: the MLX thread holds work that would compete with a reply until it is written.

After a decode step the MLX thread dispatches the next forward at once (the after-reply hook),
and on a CPU with few cores that forward's threads take the cores just when the event loop must
encode and write the reply: the reply waits behind them. With a gate, the MLX thread waits
(bounded by HOLD_SECONDS) until the event loop has handed the reply to the socket; the forward
then starts a few tenths of a millisecond later, but the scheduler has its reply sooner. Only
after calls long enough that this delay is a small share of a step (HOLD_MIN_CALL_SECONDS).
"""

from __future__ import annotations

import threading

# The longest the MLX thread waits for a reply's write (a 64-row reply is written in well under
# it); past it the hook runs anyway, so a reply the loop never writes costs no more than this.
HOLD_SECONDS = 0.002
# Only after a call this long (its time on the MLX thread, the forward it waited on included): the
# hold delays the next forward by about the reply's write (~0.1-0.3 ms), a few percent of such a
# step but a large share of a small model's (~0.5 ms: there it measurably cost tokens per second).
HOLD_MIN_CALL_SECONDS = 0.002


class ReplyGate:
    """Opened once, by the event loop, when the reply is written (or will not be); waited on
    once, by the MLX thread. A lock held from birth: `wait` is one C-level timed acquire."""

    __slots__ = ("_lock", "_open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._open = False

    def open(self) -> None:
        if not self._open:
            self._open = True
            self._lock.release()

    @property
    def is_open(self) -> bool:
        return self._open

    def wait(self, timeout: float = HOLD_SECONDS) -> bool:
        """True when the gate opened within `timeout`."""
        return self._lock.acquire(timeout=timeout)
