from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from sidecar.client import RemoteError, RemoteWorker
from sidecar.config import Config
from sidecar.server.startup import Startup, preload
from sidecar.worker import MLXWorker
from tests.server.serverproc import _probe, spawn

# A preload of a few seconds on the tiny model (a 4096-token profile prefill, twice), so a client
# started right after the socket opens certainly meets it still starting.
SLOW_PRELOAD = ["--preload", "--max-num-batched-tokens", "4096", "--max-model-len", "4096", "--max-num-seqs", "4"]


def _wait_for(server, path: str, timeout: float = 60.0) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.returncode is None, server.stderr()
        answer = _probe(server, path)
        if answer is not None:
            return answer[0], json.loads(answer[1])
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not answer:\n{server.stderr()}")


def test_clients_wait_for_a_preloading_server_instead_of_racing_it(home: str) -> None:
    with spawn(*SLOW_PRELOAD) as s:
        status, body = _wait_for(s, "/readyz")
        assert status == 503 and body["starting"], body
        gen = subprocess.Popen([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "--max-tokens", "8", "hello"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # A second client driving the lifecycle meets 503 + Retry-After naming the stage, not a 409.
        other = RemoteWorker(s.url)
        with pytest.raises(RemoteError) as e:
            other.init_device()
        assert e.value.status == 503 and e.value.retry_after and e.value.retry_after >= 1
        assert e.value.message.startswith("starting: "), e.value.message
        assert other.info()["starting"]
        out, err = gen.communicate(timeout=120)
        assert gen.returncode == 0, err
        assert out.strip(), (out, err)
        assert "waiting for the server (starting: " in err  # it met the preload, and said so
        # Once up, the same call is an ordinary lifecycle error again, and /readyz says ready.
        status, body = _wait_for(s, "/readyz")
        assert status == 200 and "starting" not in body, body
        with pytest.raises(RemoteError) as e:
            other.init_device()
        assert e.value.status == 409
        assert other.info()["starting"] is None
        other.close()


def test_startup_records_each_stage_and_clears_on_failure(home: str) -> None:
    seen: list[tuple[str, float]] = []
    st = Startup(report=lambda stage, seconds: seen.append((stage, seconds)))
    w = MLXWorker(Config(model="builtin:tiny", home=home, max_num_batched_tokens=64, max_num_seqs=2))
    preload(w, startup=st)
    names = [name for name, _ in seen]
    assert names[1].endswith("loading the model")  # "building builtin:tiny (first use) and ..." on first use
    assert names[:1] + names[2:] == ["initialising the device", "measuring memory", "allocating the cache", "warming up"]
    assert all(seconds >= 0 for _, seconds in seen) and seen == st.done
    assert st.stage is None and w.state.value == "ready"
    bad = Startup()
    with pytest.raises(Exception):
        preload(MLXWorker(Config(model="builtin:no-such-model", home=home)), startup=bad)
    assert bad.stage is None and [n for n, _ in bad.done] == ["initialising the device"]
