"""A lost rank, for real: SIGKILL or SIGSTOP one process of a 2-rank group on loopback. Rank 0
reports it (/readyz 503 naming the rank, mlx_worker_healthy 0, mlx_worker_rank_up{rank="1"} 0)
within 10 s, exits non-zero by default or stays up refusing calls with the flag off; no call
hangs; a follower whose rank 0 dies exits non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from tests.distributed.groupproc import Group, start_group
from tests.driver import Driver

pytestmark = pytest.mark.distributed

FLAGS = ("--tensor-parallel", "2", "--preload", "--max-model-len", "256", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64")


def steps_until_error(group: Group, errors: list, stop: threading.Event) -> None:
    """Keep a request decoding until a call fails; record how it failed."""
    remote = RemoteWorker(group.leader.url, timeout=30)
    try:
        d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 64)
        n = 0
        d.add("r0", list(range(3, 30)))
        while not stop.is_set():
            d.step()
            r = d.reqs[f"r{n}"]
            if len(r.out) > 100:  # start a fresh request: the driver never reuses blocks, and a fast
                d.free += r.blocks  # machine decodes past its whole pool before the kill
                d.finish(r.rid)
                n += 1
                d.add(f"r{n}", list(range(3, 30)))
    except (RemoteError, OSError) as e:
        errors.append(e)
    finally:
        remote.close()


def readyz(group: Group) -> tuple[int, dict] | None:
    try:
        r = httpx.get(f"{group.leader.url}/readyz", timeout=2)
        return r.status_code, r.json()
    except httpx.HTTPError:
        return None


# PP=2 too: a stage's recv/send and all_gather in one forward hung rank 0 as the TP all_sums did
# (distributed/inflight.py).
PP_FLAGS = ("--pipeline-parallel", "2", "--model", "builtin:tiny-qwen2", *FLAGS[2:])


@pytest.mark.parametrize("flags", [FLAGS, PP_FLAGS], ids=["tp", "pp"])
def test_killed_rank_1_makes_rank_0_unhealthy_then_exit_nonzero(home: str, flags: tuple[str, ...]) -> None:
    with start_group(*flags) as g:
        errors: list = []
        stop = threading.Event()
        t = threading.Thread(target=steps_until_error, args=(g, errors, stop), daemon=True)
        t.start()
        time.sleep(1.0)  # mid-run
        assert not errors, errors
        g.followers[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        seen = None
        while g.leader.returncode is None and time.monotonic() - t0 < 60:  # bounded, and generous on a busy machine
            got = readyz(g)
            if got and got[0] == 503 and seen is None:
                seen = (time.monotonic() - t0, got[1])
            time.sleep(0.05)
        took = time.monotonic() - t0
        stop.set()
        t.join(10)
        assert g.leader.returncode not in (None, 0), f"rank 0 still running after {took:.1f}s"
        assert took < 60
        assert seen is not None, "no 503 from /readyz before the exit"
        assert seen[1]["healthy"] is False and seen[1]["group"]["ranks"] == {"0": True, "1": False}
        assert seen[1]["group"]["lost"].startswith("rank 1 lost")
        assert errors and not t.is_alive()  # the in-flight step answered (503) or the socket closed: no hang
        if isinstance(errors[0], RemoteError):
            assert errors[0].status == 503 and "rank 1" in errors[0].message
        assert "rank 1 lost" in g.leader.stderr()


def test_stopped_rank_1_mid_step_without_exit_flag_stays_up_unhealthy(home: str) -> None:
    # The step's own watchdog finds it (heartbeats off) and answers the call stuck in the collective.
    flags = (*FLAGS, "--no-exit-on-rank-failure", "--rank-timeout", "2", "--heartbeat-interval", "60")
    with start_group(*flags) as g:
        remote = RemoteWorker(g.leader.url, timeout=30)
        d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 64)
        d.add("r", list(range(3, 30)))
        d.step()
        assert readyz(g)[0] == 200
        os.kill(g.followers[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as e:
                d.step()
            # the watchdog's answer (rank timeout 2 s), not the client's 30 s timeout
            assert e.value.status == 503 and time.monotonic() - t0 < 25
            status, body = readyz(g)
            assert status == 503 and body["group"]["ranks"]["1"] is False and "rank 1 lost" in body["group"]["lost"]
            text = httpx.get(f"{g.leader.url}/metrics", timeout=5).text
            assert re.search(r"^mlx_worker_healthy 0\.0$", text, re.M)
            assert 'mlx_worker_rank_up{rank="1"} 0.0' in text and 'mlx_worker_rank_up{rank="0"} 1.0' in text
            t1 = time.monotonic()
            with pytest.raises(RemoteError) as e2:  # refused at once, not queued behind the stuck collective
                remote.check_health()
            assert e2.value.status == 503 and "rank 1" in e2.value.message and time.monotonic() - t1 < 10
            assert httpx.get(f"{g.leader.url}/healthz", timeout=5).status_code == 200
            time.sleep(1.5)
            assert g.leader.returncode is None  # stays up without the flag
        finally:
            remote.close()
            g.followers[0].send_signal(signal.SIGKILL)
            os.kill(g.followers[0].pid, signal.SIGCONT)


def test_follower_exits_nonzero_when_rank_0_dies(home: str) -> None:
    with start_group(*FLAGS) as g:
        g.leader.proc.send_signal(signal.SIGKILL)
        try:
            code = g.followers[0].wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 1 still running 10 s after rank 0 died")
        assert code != 0
        assert "rank 0 lost" in g.follower_log() or "group failed" in g.follower_log()


def test_rank_0_alone_answers_probes_until_rank_1_joins(home: str, tmp_path) -> None:
    """After a restart rank 0 waits in mx.distributed.init for the others: its port still answers,
    unhealthy, naming the rank not yet there; once rank 1 starts the group serves."""
    from tests.distributed.groupproc import hostfile
    from tests.server.serverproc import ROOT, start_server

    hosts = hostfile(2, tmp_path)
    leader = start_server(*FLAGS, env={"MLX_HOSTFILE": str(hosts), "MLX_RANK": "0"}, ready=False)
    follower = None
    try:
        r = httpx.get(f"{leader.url}/readyz", timeout=5)
        assert r.status_code == 503 and r.json()["state"] == "forming"
        assert r.json()["group"]["ranks"] == {"0": True, "1": False}
        text = httpx.get(f"{leader.url}/metrics", timeout=5).text
        assert 'mlx_worker_rank_up{rank="1"} 0.0' in text and re.search(r"^mlx_worker_healthy 0\.0$", text, re.M)
        rpc = httpx.post(f"{leader.url}/rpc/check_health", json={}, timeout=5)
        assert rpc.status_code == 503 and "waiting" in rpc.json()["error"]["message"]
        client = RemoteWorker(leader.url)
        try:
            with pytest.raises(RemoteError) as e:  # msgpack in, msgpack out, as the real server
                client.check_health()
        finally:
            client.close()
        assert e.value.status == 503 and "forming" in e.value.message
        follower = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", *FLAGS], cwd=ROOT,
                                    env={**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": "1",
                                         "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while readyz_status(leader.url) != 200:
            assert time.monotonic() < deadline and leader.returncode is None, leader.stderr()[-2000:]
            time.sleep(0.2)
        body = httpx.get(f"{leader.url}/readyz", timeout=5).json()
        assert body["group"]["ranks"] == {"0": True, "1": True} and body["state"] == "ready"
    finally:
        leader.stop(timeout=20)
        if follower is not None:
            try:
                follower.wait(20)
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait(10)


def readyz_status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return None
