"""bench/idle.py: the sidecar's MLX thread idle share while steps run, from its real /metrics."""

from __future__ import annotations

import time
from typing import Callable

from bench.idle import IdleProbe, Sample, idle_share, parse
from sidecar.client.remote import RemoteWorker
from sidecar.scheduler.generate import bring_up
from sidecar.scheduler.scheduler import Request, Scheduler, run
from tests.server.serverproc import start_server


def test_parse_reads_both_counters_and_nothing_like_them() -> None:
    text = ("# HELP mlx_worker_steps_total x\nmlx_worker_steps_created 1.7e9\nmlx_worker_steps_total 12.0\n"
            "mlx_worker_more_decode_steps_total 99.0\nmlx_worker_mlx_thread_idle_seconds_total 3.5\n")
    assert parse(text) == (3.5, 12.0)
    assert parse(text.replace("mlx_worker_steps_total 12.0", "")) is None  # one missing: no figure, not a 0


def test_the_window_is_where_steps_ran() -> None:
    # Idle 10 s before the traffic and 10 s after it; inside it, 0.1 s idle a second.
    samples = [Sample(0.0, 0.0, 0), Sample(10.0, 10.0, 0), Sample(11.0, 10.1, 100), Sample(12.0, 10.2, 200),
               Sample(13.0, 10.3, 300), Sample(14.0, 10.4, 300), Sample(24.0, 20.4, 300)]
    share, steps = idle_share(samples)  # type: ignore[misc]
    assert abs(share - 0.1) < 1e-9 and steps == 100  # (12 s to 13 s may have held the end: left out)
    assert idle_share(samples[:3]) is None  # one sample inside: no window
    assert idle_share([Sample(0.0, 0.0, 5), Sample(1.0, 1.0, 5)]) is None  # no steps at all


def _burst(step: Callable[[dict], dict], sched: Scheduler, steps: int) -> None:
    for _ in range(steps):
        so = sched.schedule()
        sched.update_from_output(so, step(so))


def test_a_pause_between_steps_is_idle_and_back_to_back_steps_are_not(home: str) -> None:
    with start_server() as s:
        w = RemoteWorker(s.url)
        bring_up(w, "created", max_blocks=64)
        info = w.info()
        shares = {}
        step = (lambda so: w.call("execute_model", scheduler_output=so))
        for pause in (0.0, 1.5):
            sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"], max_num_batched_tokens=64)
            sched.add_request(Request(f"r{pause}", [1, 2, 3, 4], {"temperature": 0.0}, max_tokens=201, ignore_eos=True))
            probe = IdleProbe(s.url, period=0.005).start()
            _burst(step, sched, 100)
            time.sleep(pause)  # the client holds the next step back: the MLX thread waits
            _burst(step, sched, 100)
            got = probe.stop()
            run(sched, step)  # (its last token and the step that frees it)
            assert got is not None and got[1] > 0
            shares[pause] = got[0]
        w.close()
    # The pause is idle the probe sees inside the window (a negative control for a share stuck at 0),
    # and the share is no artefact of sampling: without a pause it is lower by much of the pause.
    assert shares[1.5] > shares[0.0] + 0.15, shares


def test_a_server_that_does_not_answer_gives_no_figure_and_no_error() -> None:
    from bench.serve import free_port

    probe = IdleProbe(f"http://127.0.0.1:{free_port()}", period=0.01).start()  # nothing listens there
    time.sleep(0.05)
    assert probe.stop() is None and probe.samples == []
