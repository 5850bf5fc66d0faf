"""One collective of a group's forward in flight at a time, so a lost peer raises instead of hanging.

MLX's ring backend (0.32) runs each socket's sends and receives on a thread of its own. When a peer
dies, that thread fails the transfers it holds ("[ring] connection to a peer was lost") and exits;
a transfer queued on it later is never answered, and the collective waiting for it blocks the
stream's thread forever. The stream's scheduler keeps running the tasks behind a failed one, so
one eval holding several all_sums (a whole forward: two per layer) hangs as soon as a third
collective is already queued when the first fails: the first two fail (one per socket thread),
the third waits on a dead thread, and the eval never returns. Whether it is queued depends on how
far MLX's enqueueing has run ahead of the stream (its in-flight bound is a few tens of graph
nodes): a graph with fewer nodes between collectives (a smaller decode graph) is more likely to
hang.

Here, while a forward is built (`guarded`, around each padded batch's forward on the MLX thread),
every mx.distributed collective the model calls (a sharded-to-all layer's all_sum, an MoE block's
own all_sum, a pipeline stage's send/recv/all_gather) is evaluated asynchronously as it is built,
after the previous one has finished: a failed collective raises in the forward, on the MLX thread,
before another is queued. The compute before a collective is queued at once (`async_eval` of its
input), so the stream runs it while the previous collective completes; only the next collective
waits. The group's collectives all run on that thread meanwhile (rank 0 holds its call lock over
the step; a follower has one loop), so swapping the module's functions for the forward's duration
reaches every caller and no one else.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import mlx.core as mx


class InFlight:
    """The last collective of the current forward queued and maybe not yet finished."""

    def __init__(self) -> None:
        self._last: mx.array | None = None

    def admit(self, x: mx.array | None) -> None:
        """Before queueing a collective on `x`: wait for the last one (raising if it failed)."""
        if x is not None:
            mx.async_eval(x)
        last, self._last = self._last, None
        if last is not None:
            mx.eval(last)

    def launched(self, out: mx.array) -> None:
        mx.async_eval(out)
        self._last = out

    def clear(self) -> None:
        """After a forward (evaluated, or raised): hold no array of it."""
        self._last = None


_COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")


def _guarded(fn: Callable[..., mx.array], flight: InFlight) -> Callable[..., mx.array]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> mx.array:
        x = next((a for a in args if isinstance(a, mx.array)), None)  # recv(shape, dtype, src) has none
        flight.admit(x)
        out = fn(*args, **kwargs)
        flight.launched(out)
        return out

    return collective


@contextlib.contextmanager
def guarded(flight: InFlight) -> Iterator[None]:
    """While the forward is built: mx.distributed's collectives one in flight at a time."""
    d = mx.distributed
    originals = {name: getattr(d, name) for name in _COLLECTIVES if hasattr(d, name)}
    for name, fn in originals.items():
        setattr(d, name, _guarded(fn, flight))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(d, name, fn)
        flight.clear()
