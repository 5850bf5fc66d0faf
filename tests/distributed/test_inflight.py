"""sidecar/distributed/inflight.py: with a peer lost mid-forward, a tensor-parallel forward raises
instead of hanging in MLX's ring backend, and while the group is whole it computes exactly what the
unguarded layers do."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

from sidecar.distributed.inflight import InFlight, guarded
from tests.distributed.groupproc import hostfile
from tests.server.serverproc import ROOT


def run_pair(mode: str, tmp_path, timeout: float = 6.0) -> tuple[str, bool]:
    """Rank 0's output of tests/distributed/inflight_rank.py, and whether it outlived `timeout`."""
    hosts = hostfile(2, tmp_path)
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.distributed.inflight_rank", mode]
    follower = subprocess.Popen(cmd, cwd=ROOT, env={**env, "MLX_RANK": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    leader = subprocess.Popen(cmd, cwd=ROOT, env={**env, "MLX_RANK": "0"}, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        out, _ = leader.communicate(timeout=timeout)
        return out, False
    except subprocess.TimeoutExpired:
        leader.kill()
        return leader.communicate()[0], True
    finally:
        follower.kill()
        follower.wait(10)


@pytest.mark.distributed
def test_lost_peer_mid_forward_raises_with_the_guard(tmp_path) -> None:
    out, hung = run_pair("guarded", tmp_path)
    assert not hung and "equal: True" in out, out
    assert "raised: [ring] connection to a peer was lost" in out, out


@pytest.mark.distributed
def test_negative_control_unguarded_forward_hangs(tmp_path) -> None:
    # What the guard is for: MLX's own layers, the same chain, one eval: the process never returns.
    out, hung = run_pair("raw", tmp_path)
    assert "equal: True" in out and hung, out


def test_guarded_forward_keeps_the_result_and_restores_mlx() -> None:
    group = mx.distributed.init()  # a group of one: the same layers and collectives, in process
    mx.random.seed(1)
    lin = [nn.Linear(32, 32) for _ in range(4)]
    model = nn.Sequential(*(AllToShardedLinear.from_linear(m, group=group) if i % 2 == 0 else
                            ShardedToAllLinear.from_linear(m, group=group) for i, m in enumerate(lin)))
    x = mx.random.normal((3, 1, 32))
    plain = model(x)
    originals = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather", "send", "recv_like")}
    flight = InFlight()
    with guarded(flight):
        assert all(getattr(mx.distributed, n) is not f for n, f in originals.items())
        y = model(x)
        assert flight._last is not None  # the last collective queued, held until the forward ends
    assert flight._last is None
    assert mx.array_equal(y, plain).item()
    with pytest.raises(ValueError), guarded(flight):
        model(x)
        raise ValueError("a forward that raised")
    assert all(getattr(mx.distributed, n) is f for n, f in originals.items()) and flight._last is None
