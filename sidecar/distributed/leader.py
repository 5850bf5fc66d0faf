"""Rank 0: the worker the HTTP server drives, leading the other ranks call by call.

Every worker call is decided on rank 0. A call that changes the ranks' state is validated here
first (the state machine, and for execute_model the whole step through plan_step), so a rejected
call never reaches another rank. Then, by kind:

- `FIRST`: sent, then run everywhere at once (they hold collectives, or take long);
- `AFTER`: run here, then sent only when it succeeded (their argument checks live in the call);
- anything else reads rank 0's state and is not sent.

A lost rank (a collective that failed, or outlived its deadline) makes the worker unhealthy,
answers every later call with 503 naming the rank, and, with exit_on_rank_failure, exits the
process so launchd/systemd restart the group. An idle group is pinged every heartbeat_interval.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.config import Config
from sidecar.distributed.group import Channel, GroupLost, Watchdog, exit_soon, is_group_error, lost_ranks
from sidecar.distributed.shard import GroupWorker
from sidecar.errors import ProtocolError, SidecarError, Unavailable
from sidecar.wire.limits import Limits, check_step_shape
from sidecar.engine import multistep
from sidecar.engine.planner import plan_step
from sidecar.worker.mlx_worker import ALLOWED

log = logging.getLogger("sidecar.distributed")

FIRST = {"load_model", "determine_available_memory", "compile_or_warm_up_model", "execute_model",
         "check_health", "wake_up"}
AFTER = {"init_device", "initialize_cache", "initialize_from_config", "sleep", "add_lora", "remove_lora",
         "pin_lora", "shutdown"}
# Calls that may run long on a healthy group: bounded by call_timeout, not rank_timeout.
LONG = {"load_model", "determine_available_memory", "compile_or_warm_up_model", "wake_up", "init_device"}
GROUP_KEYS = ("tensor_parallel", "pipeline_parallel", "distributed_backend")


def deadline(config: Config, method: str) -> float:
    return max(config.rank_timeout, config.call_timeout) if method in LONG else config.rank_timeout


class LeaderWorker(GroupWorker):
    def __init__(self, config: Config, channel: Channel, **kwargs: Any):
        super().__init__(config, channel, **kwargs)
        self.lost: str | None = None
        self.lost_ranks: list[int] = []
        self._lock = threading.Lock()  # one call or ping on the group at a time, in rank 0's order
        self._depth = 0  # nested worker calls (initialize_from_config -> initialize_cache) are not re-sent
        self._closed = False
        self._thread: Any = None  # the server's MLXThread, to answer a call stuck on a lost rank
        self.watchdog = Watchdog(lambda s, what: self._lose(f"no answer to {what} within {s:.1f}s"))
        threading.Thread(target=self._heartbeat, name="sidecar-heartbeat", daemon=True).start()

    # --- leading --------------------------------------------------------------------------------

    def _lead(self, name: str, base: Callable, kw: dict) -> Any:
        if self._depth or (name not in FIRST and name not in AFTER):
            return base(self, **kw)
        if name == "init_device":
            self._check_group_keys(kw.get("config"))
        if self.lost is not None:
            if name == "shutdown":
                return base(self, **kw)  # free this rank; the others are gone or stuck
            raise Unavailable(self.unavailable or "", retry_after=5)
        with self._lock:
            self._depth += 1
            try:
                with self.watchdog.watch(deadline(self.config, name), name):
                    if name in AFTER:
                        result = base(self, **kw)
                        self.channel.send({"m": name, "k": kw})
                        return result
                    run = self._validate(name, kw)
                    self.channel.send({"m": name, "k": kw})
                    try:
                        return run()
                    except SidecarError:
                        raise
                    except Exception as e:
                        if is_group_error(e):
                            raise GroupLost(str(e)) from e
                        # The others ran it: their state may now differ from ours.
                        self._lose(f"rank 0 failed {name} after sending it ({type(e).__name__}: {e})")
                        raise
            except GroupLost as e:
                self._lose(f"{name}: {e}")
                raise Unavailable(self.unavailable or str(e), retry_after=5) from None
            finally:
                self._depth -= 1

    def _validate(self, name: str, kw: dict) -> Callable[[], Any]:
        """Everything that could reject a FIRST call, checked before any rank sees it."""
        self.require(name)
        base = getattr(GroupWorker, name)
        if name == "execute_model":
            runner = self.runner
            assert runner is not None and runner.pool is not None
            check_step_shape(kw["scheduler_output"], runner.requests, Limits.of(self.config, runner.max_model_len,
                                                                               runner.vocab_size))
            out = runner.decode(kw["scheduler_output"])
            if out.scheduled_spec_decode_tokens:  # verifying drafts samples inside the verify step
                raise ProtocolError(f"draft tokens are not supported with --{self.mode}-parallel",
                                    field="scheduled_spec_decode_tokens")
            multistep.check(out, defer_sampling=False)
            plan_step(runner.requests, out, num_blocks=runner.pool.num_blocks, block_size=runner.pool.block_size,
                      vocab_size=runner.vocab_size, max_model_len=runner.max_model_len, loras=runner.lora.adapters.keys())
            return lambda: runner.execute_model(out)
        if name == "wake_up":
            tags = kw.get("tags")
            if tags is not None and (not isinstance(tags, list) or any(t not in ("weights", "kv_cache") for t in tags)):
                raise ProtocolError(f"tags must be null or a list of weights, kv_cache; got {tags!r}", field="tags")
        return lambda: base(self, **kw)

    def _check_group_keys(self, config: Any) -> None:
        for key in GROUP_KEYS:
            if isinstance(config, dict) and key in config and config[key] != getattr(self.config, key):
                raise ProtocolError(f"{key} is fixed when the group starts ({getattr(self.config, key)!r})",
                                    field=f"config.{key}")

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval
        while not self._closed and self.lost is None:
            time.sleep(interval / 2)
            if time.time() - self.channel.last_ok < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                with self.watchdog.watch(min(3.0, self.config.rank_timeout), "a heartbeat"):
                    self.channel.send({"m": "__ping__"})
            except GroupLost as e:
                self._lose(f"heartbeat: {e}")
            finally:
                self._lock.release()

    def _lose(self, reason: str) -> None:
        if self.lost is not None or self._closed:
            return
        self.lost_ranks = lost_ranks(self.world_size)
        names = ", ".join(map(str, self.lost_ranks))
        self.lost = f"rank {names} lost ({reason})"
        self.healthy = False
        log.error("%s", self.lost)
        if self._thread is not None:  # a call stuck in a collective would otherwise never answer
            self._thread.fail_running(Unavailable(self.unavailable or self.lost, retry_after=5))
        if self.config.exit_on_rank_failure:
            log.error("exiting (exit_on_rank_failure): the service manager restarts the group")
            exit_soon(1, 1.0)

    def attach_thread(self, thread: Any) -> None:
        self._thread = thread

    def close(self) -> None:
        """Tell the other ranks to exit (after the server drained)."""
        if self.lost is None and not self._closed:
            with self._lock, self.watchdog.watch(3.0, "the exit message"):
                try:
                    self.channel.send({"m": "__exit__"})
                except GroupLost:
                    pass
        self._closed = True

    # --- what probes and metrics read -------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why every RPC is refused now (the server checks it before queueing a call)."""
        return f"group lost: {self.lost}; restart every rank" if self.lost else None

    def group_status(self) -> dict:
        return {"world_size": self.world_size, "mode": self.mode, "lost": self.lost,
                "ranks": {str(r): r not in self.lost_ranks for r in range(self.world_size)},
                "last_collective_timestamp_seconds": self.channel.last_ok}

    def metrics_collector(self) -> Collector:
        return _GroupCollector(self)


def _leading(name: str) -> Callable:
    base = getattr(GroupWorker, name)
    sig = inspect.signature(base)

    @functools.wraps(base)
    def call(self: LeaderWorker, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        kw = {k: v for k, v in bound.arguments.items() if k != "self"}
        return self._lead(name, base, kw)

    return call


for _name in ALLOWED:
    if _name not in LeaderWorker.__dict__:
        setattr(LeaderWorker, _name, _leading(_name))


class _GroupCollector(Collector):
    def __init__(self, w: LeaderWorker):
        self.w = w

    def collect(self) -> Iterator[Metric]:
        w = self.w
        up = GaugeMetricFamily("mlx_worker_rank_up", "1 while the rank answers the group's collectives", labels=["rank"])
        for r in range(w.world_size):
            up.add_metric([str(r)], 0.0 if r in w.lost_ranks else 1.0)
        yield up
        yield GaugeMetricFamily("mlx_worker_group_size", "Ranks in the mx.distributed group", value=w.world_size)
        yield GaugeMetricFamily("mlx_worker_group_last_collective_timestamp_seconds",
                                "Unix time the group last completed a collective", value=w.channel.last_ok)
        yield CounterMetricFamily("mlx_worker_group_collective_seconds", "Time rank 0 spent in the group's "
                                  "messages and token shares (the model's own collectives excluded)", value=w.channel.seconds)
        yield CounterMetricFamily("mlx_worker_group_messages", "Calls and pings sent to the group",
                                  value=w.channel.messages)
