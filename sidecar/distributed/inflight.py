"""One collective of a tensor-parallel forward in flight at a time, so a lost peer raises instead of hanging.

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

Here each of the model's sharded-to-all layers (the layers whose all_sum mlx-lm's `shard` puts
in the forward) is evaluated asynchronously as it is built, after the previous one has finished:
a failed collective raises in the forward, from the MLX thread, before another is queued. The
compute between two collectives is queued at once (`async_eval` of the layer's input), so the
stream runs it while the previous collective completes; only the next collective waits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear


class InFlight:
    """The last collective of the current forward queued and maybe not yet finished."""

    def __init__(self) -> None:
        self._last: mx.array | None = None

    def admit(self, x: mx.array) -> None:
        """Before queueing a collective on `x`: wait for the last one (raising if it failed)."""
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


def _guarded(base: type) -> type:
    def __call__(self: Any, x: mx.array) -> mx.array:
        flight: InFlight = self.__dict__["_in_flight"]
        flight.admit(x)
        out = base.__call__(self, x)
        flight.launched(out)
        return out

    return type(f"OneInFlight{base.__name__}", (base,), {"__call__": __call__})


_SWAPS: dict[type, type] = {base: _guarded(base) for base in (ShardedToAllLinear, QuantizedShardedToAllLinear)}


def one_collective_in_flight(model: nn.Module, flight: InFlight) -> int:
    """Swap the sharded model's sharded-to-all layers for ones that queue their all_sum only after
    the last one finished (parameters and names unchanged). Returns how many were swapped."""
    n = 0
    for _, m in model.named_modules():
        swap = _SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
            object.__setattr__(m, "_in_flight", flight)  # not a parameter
            n += 1
    return n
