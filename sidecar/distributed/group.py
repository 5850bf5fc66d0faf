"""The group of ranks and the one channel rank 0 uses to lead it, over mx.distributed only.

Every message travels as a collective of the group itself: rank 0 contributes the bytes, the
others zeros, and `all_sum` hands everyone the same bytes (no transport of ours). A message is one
all_sum of a fixed `HEAD` bytes (length + start of the msgpack body), plus one more for the rest of
a long body; the sampled tokens of a step are one more all_sum of int32s.

A collective only completes when every rank takes part, so completing one is the liveness proof.
A dead peer makes MLX's ring backend fail the pending collective within about a second
("[ring] connection to a peer was lost"); a peer that stops answering (SIGSTOP, a hung host, a
pulled cable) leaves it pending forever. `Watchdog` bounds that: every collective region runs
under a deadline, and a monitor thread reports the group lost when one passes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterator

import mlx.core as mx
import msgpack
import numpy as np

log = logging.getLogger("sidecar.distributed")

HEAD = 4096  # bytes every message costs: 8 of length, then the body's first bytes


class GroupLost(RuntimeError):
    """A collective failed or timed out: the group no longer runs in lockstep."""


def init_group(backend: str = "ring", rank: int | None = None, init_method: str = "") -> mx.distributed.Group:
    """mx.distributed.init from the environment `mlx.launch` sets (MLX_RANK, MLX_HOSTFILE, ...) or,
    for a worker built in-process, from its `rank` and a `distributed_init_method` naming a
    hostfile (`ring://<path>` or a plain path)."""
    if init_method:
        path = init_method.split("://", 1)[1] if "://" in init_method else init_method
        os.environ["MLX_HOSTFILE"] = path
        if rank is not None:
            os.environ["MLX_RANK"] = str(rank)
    return mx.distributed.init(strict=True, backend=backend)


class Watchdog:
    """Deadlines for collective regions; `on_timeout(seconds, what)` runs on the monitor thread."""

    def __init__(self, on_timeout: Callable[[float, str], None], poll: float = 0.1):
        self._on_timeout = on_timeout
        self._poll = poll
        self._region: tuple[float, float, str] | None = None  # (started, deadline, what)
        self._fired = False
        threading.Thread(target=self._run, name="sidecar-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, timeout: float, what: str) -> Iterator[None]:
        now = time.monotonic()
        self._region = (now, now + timeout, what)
        try:
            yield
        finally:
            self._region = None

    def _run(self) -> None:
        while not self._fired:
            time.sleep(self._poll)
            region = self._region
            if region is not None and time.monotonic() > region[1]:
                self._fired = True
                self._on_timeout(time.monotonic() - region[0], region[2])


class Channel:
    """Rank 0's messages and tokens to the rest of the group. Collective order must be the same
    on every rank: rank 0 decides it (under its call lock), the others follow their messages."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.last_ok = time.time()  # unix time the group last completed a collective
        self.seconds = 0.0  # total time spent in this channel's collectives
        self.messages = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _sum(self, a: mx.array) -> mx.array:
        t0 = time.perf_counter()
        try:
            out = mx.distributed.all_sum(a, group=self.group)
            mx.eval(out)
        except RuntimeError as e:  # MLX's ring backend: a peer's socket closed
            raise GroupLost(str(e)) from e
        self.seconds += time.perf_counter() - t0
        self.last_ok = time.time()
        return out

    def send(self, message: dict) -> None:
        """Rank 0: every rank receives `message` (msgpack-able) from its `recv`."""
        assert self.leader
        body = msgpack.packb(message, use_bin_type=True)
        data = len(body).to_bytes(8, "little") + body
        head = np.zeros(HEAD, np.uint8)
        head[: min(HEAD, len(data))] = np.frombuffer(data[:HEAD], np.uint8)
        self._sum(mx.array(head))
        if len(data) > HEAD:
            self._sum(mx.array(np.frombuffer(data[HEAD:], np.uint8)))
        self.messages += 1

    def recv(self) -> dict:
        assert not self.leader
        head = bytes(np.array(self._sum(mx.zeros((HEAD,), mx.uint8))))
        n = int.from_bytes(head[:8], "little")
        data = head[8 : 8 + n]
        if 8 + n > HEAD:
            data += bytes(np.array(self._sum(mx.zeros((8 + n - HEAD,), mx.uint8))))
        self.messages += 1
        return msgpack.unpackb(data, raw=False, strict_map_key=False)

    def share_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """Rank 0's sampled tokens to every rank (the others pass None)."""
        a = mx.array(tokens, mx.int32) if self.leader else mx.zeros((n,), mx.int32)
        return self._sum(a).tolist() if n else []

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t0 = time.perf_counter()
        try:
            out = mx.distributed.all_min(mx.array([value], mx.int64), group=self.group)
            mx.eval(out)
        except RuntimeError as e:
            raise GroupLost(str(e)) from e
        self.seconds += time.perf_counter() - t0
        return int(out.item())


_BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer")


def is_group_error(e: BaseException) -> bool:
    """A failed collective, raised by MLX from inside any eval (a model's own all_sum or send)."""
    return isinstance(e, GroupLost) or (isinstance(e, RuntimeError) and any(k in str(e) for k in _BACKEND_ERRORS))


def lost_ranks(size: int) -> list[int]:
    """Who a failed collective lost. A ring collective cannot tell which peer stopped; with two
    ranks it is rank 1, with more every follower is suspect until the group restarts."""
    return list(range(1, size))


def exit_soon(code: int, delay: float) -> None:
    """Exit the process from a timer thread: the MLX thread may be stuck in a collective forever,
    so no clean shutdown is possible; the delay lets a probe and a scrape see the failure."""

    def die() -> None:
        time.sleep(delay)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=die, name="sidecar-exit", daemon=True).start()
