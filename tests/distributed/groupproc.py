"""Start a real group of `mlx-sidecar serve` ranks on loopback (ring backend, CPU): rank 0 through
tests/server/serverproc.py (HTTP on a free port), ranks 1.. as plain subprocesses. Each rank gets
MLX_RANK and MLX_HOSTFILE, exactly what `mlx.launch --backend ring` exports.

    with start_group("--tensor-parallel", "2", "--preload") as g:
        g.leader.url; g.followers[0].pid
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.server.serverproc import ROOT, Server, free_port, spawn, start_server


@dataclass
class Group:
    leader: Server
    followers: list[subprocess.Popen]
    workdir: Path

    def follower_log(self, i: int = 0) -> str:
        return (self.workdir / f"rank{i + 1}.log").read_text(errors="replace")

    def stop(self) -> None:
        self.leader.stop(timeout=20)
        for p in self.followers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def hostfile(n: int, workdir: Path) -> Path:
    path = workdir / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
    return path


def start_group(*flags: str, ranks: int = 2, ready: bool | None = None, timeout: float = 120.0) -> Group:
    workdir = Path(tempfile.mkdtemp(prefix="sidecar-group-"))
    atexit.register(shutil.rmtree, workdir, True)
    hosts = hostfile(ranks, workdir)
    env = {**os.environ, "MLX_HOSTFILE": str(hosts)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    followers = []
    for r in range(1, ranks):
        with open(workdir / f"rank{r}.log", "wb") as log:
            followers.append(subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--log-level", "info", *flags],
                                              cwd=ROOT, env={**env, "MLX_RANK": str(r)}, stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=log))
    try:
        leader = start_server(*flags, env={"MLX_HOSTFILE": str(hosts), "MLX_RANK": "0"}, ready=ready, timeout=timeout)
    except BaseException:
        for p in followers:
            p.kill()
            p.wait(10)
        raise
    return Group(leader, followers, workdir)


__all__ = ["Group", "hostfile", "spawn", "start_group"]
