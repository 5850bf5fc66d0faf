"""The device's idle time per decode step (server/deviceidle.py): the stream thread is found, its
busy time is exact, a step period counts only after another step, and a real server reports it in
/info per batch size (a client's pause between steps shows up in it; back-to-back steps' does not)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from sidecar.client import RemoteWorker
from sidecar.server.deviceidle import DeviceIdle, discover_stream_threads
from tests.driver import Driver


class _Worker:
    """A thread that computes (C code, GIL released) or sleeps when told to."""

    def __init__(self) -> None:
        self.todo: list[tuple[str, float]] = []
        self.go, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        data = b"x" * (1 << 22)
        while True:
            self.go.wait()
            self.go.clear()
            kind, seconds = self.todo.pop()
            if kind == "stop":
                return
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                if kind == "busy":
                    hashlib.sha256(data).digest()
                else:
                    time.sleep(0.001)
            self.done.set()

    def do(self, kind: str, seconds: float) -> None:
        self.done.clear()
        self.todo.append((kind, seconds))
        self.go.set()
        assert self.done.wait(10)


def test_idle_is_wall_time_minus_the_threads_busy_time() -> None:
    w = _Worker()
    try:
        d = DeviceIdle([w.thread.native_id])
        assert d.enabled and d.totals == {}
        d.mark(None, True)  # a step (not a decode): the next period starts here
        w.do("sleep", 0.2)
        d.mark(1, True)  # a decode step after 0.2 s of sleeping
        idle, steps = d.totals["1"]["seconds"], d.totals["1"]["steps"]
        assert steps == 1 and 0.15 < idle < 0.4
        w.do("busy", 0.2)
        d.mark(1, True)  # a period of computing: (almost) no idle added
        assert d.totals["1"]["steps"] == 2 and d.totals["1"]["seconds"] - idle < 0.05
        # A period after another call is not a decode stream's: not counted.
        d.mark(None, False)
        w.do("sleep", 0.1)
        d.mark(1, True)
        assert d.totals["1"]["steps"] == 2
        w.do("sleep", 0.1)
        d.mark(4, True)  # by batch size
        assert d.totals["4"]["steps"] == 1 and d.totals["4"]["seconds"] > 0.05
    finally:
        w.todo.append(("stop", 0))
        w.go.set()


def test_a_wait_still_going_on_at_a_reading_is_counted_at_the_next(monkeypatch) -> None:
    """A stream thread waiting for a core when a step's reply is handed over has that wait counted
    only at the next reading: that step reads idle it was not, the next one less than none. The
    totals keep both (they add up to the truth); clamping each step at zero would keep the first."""
    from types import SimpleNamespace

    from sidecar.server import deviceidle

    d = DeviceIdle([threading.get_native_id()])
    clock = iter([0.0, 10.0, 20.0, 30.0])
    busy = iter([0.0, 9.0, 20.0, 29.0])  # busy 9, 11, 9 s of 10: a wait of the first period read in the second
    monkeypatch.setattr(deviceidle, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(d, "busy", lambda: next(busy))
    d.mark(None, True)
    for _ in range(3):
        d.mark(1, True)
    assert d.totals["1"] == {"seconds": 1.0, "steps": 3, "round_trip_seconds": 0.0,
                             "round_trip_steps": 0}  # 1 + (-1) + 1; per-step clamping: 2


def test_a_sampled_call_start_splits_off_the_round_trip(monkeypatch) -> None:
    """A step's period read at its call's start too: the idle before it (the round trip) apart from
    the idle in it; only every START_EVERY-th call is read."""
    from sidecar.server import deviceidle

    monkeypatch.setattr(deviceidle, "START_EVERY", 2)
    w = _Worker()
    try:
        d = DeviceIdle([w.thread.native_id])
        d.mark(None, True)
        for _ in range(2):  # the 1st call is not read, the 2nd is
            w.do("sleep", 0.15)  # the device idles in the round trip ...
            d.started()
            w.do("busy", 0.15)  # ... and computes in the step
            d.mark(1, True)
        got = d.totals["1"]
        assert got["steps"] == 2 and got["round_trip_steps"] == 1
        assert 0.1 < got["round_trip_seconds"] < 0.3 and 0.2 < got["seconds"] < 0.5
        for _ in range(2):  # the converse: busy through the round trip, idle in the step
            w.do("busy", 0.15)
            d.started()
            w.do("sleep", 0.15)
            d.mark(1, True)
        after = d.totals["1"]
        assert after["round_trip_steps"] == 2 and after["round_trip_seconds"] - got["round_trip_seconds"] < 0.05
        assert after["seconds"] - got["seconds"] > 0.2
    finally:
        w.todo.append(("stop", 0))
        w.go.set()


def test_nothing_is_measured_without_threads() -> None:
    d = DeviceIdle([])
    d.mark(1, True)
    d.mark(1, True)
    assert not d.enabled and d.totals is None


def test_the_stream_thread_found_is_the_one_that_computes_that_threads_arrays() -> None:
    import mlx.core as mx

    found: list[list[int]] = []
    go = threading.Event()
    busy: list[float] = []

    def mlx_thread() -> None:
        found.append(discover_stream_threads())
        go.wait(10)
        d = DeviceIdle(found[0])
        t0, b0 = time.perf_counter(), d.busy()
        a = mx.random.normal((512, 512))
        for _ in range(6):
            a = (a @ a) / 512
        mx.eval(a)
        busy.append((d.busy() - b0) / (time.perf_counter() - t0))

    t = threading.Thread(target=mlx_thread)
    t.start()
    while not found:
        time.sleep(0.001)
    (tids,) = found
    assert len(tids) == 1 and tids[0] != t.native_id and tids[0] != threading.get_native_id()
    # Another thread's stream is another thread (so the one found is that thread's own).
    other: list[list[int]] = []
    t2 = threading.Thread(target=lambda: other.append(discover_stream_threads()))
    t2.start()
    t2.join()
    assert other[0] and set(other[0]).isdisjoint(tids)
    go.set()
    t.join()
    assert busy[0] > 0.5  # the found thread was busy for most of the computation


@pytest.fixture
def server(shared_server):
    return shared_server


def test_a_real_server_reports_device_idle_per_decode_batch(server) -> None:
    w = RemoteWorker(server.url)
    try:
        def totals() -> dict:
            return w.info()["device_idle"] or {}

        ahead0 = w.info()["decode_ahead"]
        d = Driver(lambda so: w.execute_model(scheduler_output=so), 16, 64)
        d.add("idle-a", list(range(40, 50)), blocks=list(range(0, 4)))
        d.add("idle-b", list(range(60, 70)), blocks=list(range(4, 8)))
        d.step(chunk=16)  # prefill: not a decode step
        before = totals().get("2", {"seconds": 0.0, "steps": 0})
        for _ in range(6):
            d.step(chunk=16)
        back_to_back = totals()["2"]
        assert back_to_back["steps"] == before["steps"] + 6
        per_step = (back_to_back["seconds"] - before["seconds"]) / 6
        # A pause of 0.3 s before one decode step: the device idled through it (after the ~1 ms
        # forward queued ahead), and the figure shows it; the back-to-back steps idled far less.
        time.sleep(0.3)
        d.step(chunk=16)
        paused = totals()["2"]
        assert paused["steps"] == back_to_back["steps"] + 1
        assert 0.25 < paused["seconds"] - back_to_back["seconds"] < 1.0
        assert per_step < 0.1  # (a fraction of the pause: on a loaded machine a starved MLX thread idles it too)
        ahead1 = w.info()["decode_ahead"]
        assert ahead1["hits"] - ahead0["hits"] >= 2 * 5  # the decode steps used the forward queued ahead
        d.finish("idle-a")
        d.finish("idle-b")
        d.step()
    finally:
        w.close()
