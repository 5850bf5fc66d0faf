"""The issue's done-when: one `mlx.launch` command starts two ranks that serve one model as one
sidecar with exactly the single-rank tokens (ring backend, loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sidecar.client.remote import RemoteWorker
from tests.driver import Driver
from tests.server.serverproc import ROOT, free_port

pytestmark = pytest.mark.distributed

PROMPTS = {"a": list(range(3, 40)), "b": [9, 8, 7, 6, 5]}


def run(execute) -> dict[str, list[int]]:
    d = Driver(execute, 16, 64)
    for rid, p in PROMPTS.items():
        d.add(rid, p)
    return d.run(8, chunk=16)


def _free_run(n: int, avoid: int) -> int:
    """A port p with p .. p+n-1 all free and none of them `avoid`: mlx.launch --starting-port gives
    the ranks consecutive ports (free_port's alone made rank 1's port the server's in one CI run)."""
    import socket

    while True:
        base = free_port()
        if avoid in range(base, base + n) or base + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def test_one_mlx_launch_command_serves_one_model(home: str, make_worker, tmp_path: Path) -> None:
    port = free_port()
    ring = _free_run(4, avoid=port)
    launcher = Path(sys.executable).parent / "mlx.launch"
    log = open(tmp_path / "launch.log", "wb")
    proc = subprocess.Popen(
        [str(launcher), "--hosts", "127.0.0.1,127.0.0.1", "--backend", "ring", "--starting-port", str(ring), "--",
         sys.executable, "-m", "sidecar", "serve", "--tensor-parallel", "2", "--preload", "--port", str(port),
         "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.2)
        remote = RemoteWorker(f"http://127.0.0.1:{port}")
        try:
            assert remote.get_model()["parallel"]["world_size"] == 2
            got = run(lambda so: remote.call("execute_model", scheduler_output=so))
        finally:
            remote.close()
        w = make_worker("builtin:tiny", 64, max_model_len=256)
        assert got == run(w.execute_model)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher and both ranks (their own session)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


IN_PROCESS = """
import json, sys
from sidecar.config import Config
from sidecar.distributed.follower import follow
from sidecar.distributed.serve import build_worker
from tests.distributed.test_serve import run

rank, hosts, home = int(sys.argv[1]), sys.argv[2], sys.argv[3]
w = build_worker(Config(model="builtin:tiny", home=home, tensor_parallel=2, max_model_len=256),
                 rank=rank, distributed_init_method="ring://" + hosts)
if rank:
    sys.exit(follow(w))
w.init_device(); w.load_model(); w.initialize_cache(64, 0)
print(json.dumps(run(w.execute_model)))
w.close()
"""


def test_in_process_group_from_constructor_arguments(home: str, make_worker, tmp_path: Path) -> None:
    """A worker built in-process joins the group from rank + distributed_init_method, no environment."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(f'[["127.0.0.1:{free_port()}"], ["127.0.0.1:{free_port()}"]]')
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", IN_PROCESS, str(r), str(hosts), home], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 0, err
        _, err1 = procs[1].communicate(timeout=30)
        assert procs[1].returncode == 75, err1  # rank 0 stopped: the follower asks to be restarted
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    w = make_worker("builtin:tiny", 64, max_model_len=256)
    import json

    assert json.loads(out.strip().splitlines()[-1]) == run(w.execute_model)
