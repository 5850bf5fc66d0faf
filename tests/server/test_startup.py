from __future__ import annotations

import io
import json
import logging
import math
import os
import select
import subprocess
import sys
import time

import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.config import Config
from sidecar.server.startup import READY, Startup, preload, progress_reporter
from sidecar.worker.mlx_worker import MLXWorker
from tests.server.serverproc import ROOT, _probe, free_port, spawn

# A preload of a few seconds on the tiny model (a 3072-token profile prefill, twice): `generate`,
# started with the server as a user would type it, meets it still starting.
SLOW_PRELOAD = ["--preload", "--max-num-batched-tokens", "3072", "--max-model-len", "4096", "--max-num-seqs", "4"]


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
    with spawn(*SLOW_PRELOAD, "--log-level", "info") as s:
        # At once, before the server even listens: it waits for the socket, then for the preload.
        gen = subprocess.Popen([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "--max-tokens", "8", "hello"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        status, body = _wait_for(s, "/readyz")
        assert status == 503 and body["starting"], body
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
        # --log-level info: each stage as one record with its duration, also when stderr is a file.
        logs = s.stderr()
        for stage in ("initialising the device", "loading the model", "measuring memory", "allocating the cache",
                      "warming up"):
            assert f"{stage} took " in logs and f"{stage} seconds=" in logs, logs


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_shows_on_a_terminal_only_unless_info_logs_are_on(caplog: pytest.LogCaptureFixture) -> None:
    tty, pipe = _Stream(True), _Stream(False)
    caplog.set_level(logging.WARNING, "sidecar.server")
    for stream in (tty, pipe):
        report = progress_reporter(stream)
        report("warming up", None)
        report("warming up", 1.5)
        report("measuring memory", None)
        report("measuring memory", math.nan)
        report(READY, 3.0)
    assert tty.getvalue() == ("mlx-sidecar: warming up ... 1.50s\nmlx-sidecar: measuring memory ... failed\n"
                              "mlx-sidecar: ready in 3.00s\n")
    assert pipe.getvalue() == "" and not caplog.records
    caplog.set_level(logging.INFO, "sidecar.server")
    progress_reporter(tty)("measuring memory", 0.25)
    assert tty.getvalue().count("\n") == 3  # the log line replaces it
    assert [r.getMessage() for r in caplog.records] == ["preload: measuring memory took 0.25s"]


def test_serve_preload_on_a_terminal_shows_each_stage_with_its_duration(home: str) -> None:
    """A real server whose stderr is a pty, at the default log level."""
    master, slave = os.openpty()
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--preload", "--port", str(port),
                             "--max-num-batched-tokens", "64", "--max-num-seqs", "2"],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    text = b""
    try:
        deadline = time.monotonic() + 60
        while b"mlx-sidecar: ready in " not in text or not text.endswith(b"s\r\n"):
            assert time.monotonic() < deadline and proc.poll() is None, text
            if select.select([master], [], [], 0.1)[0]:
                text += os.read(master, 4096)
    finally:
        proc.terminate()
        proc.wait(30)
        os.close(master)
    lines = text.decode().replace("\r\n", "\n").splitlines()
    assert lines[-1].startswith("mlx-sidecar: ready in ")
    stages = [line.removeprefix("mlx-sidecar: ").rsplit(" ... ", 1) for line in lines if " ... " in line]
    assert [name for name, _ in stages][2:] == ["measuring memory", "allocating the cache", "warming up"], lines
    assert stages[1][0].endswith("loading the model")
    assert all(float(took.removesuffix("s")) >= 0 for _, took in stages)


def test_startup_records_each_stage_and_clears_on_failure(home: str) -> None:
    seen: list[tuple[str, float | None]] = []
    st = Startup(report=lambda stage, seconds: seen.append((stage, seconds)))
    w = MLXWorker(Config(model="builtin:tiny", home=home, max_num_batched_tokens=64, max_num_seqs=2))
    preload(w, startup=st)
    assert seen[-1][0] == READY and seen[-1][1] == pytest.approx(sum(t for _, t in st.done))
    seen.pop()
    began = [name for name, seconds in seen if seconds is None]
    seen = [(name, seconds) for name, seconds in seen if seconds is not None]
    names = [name for name, _ in seen]
    assert began == names  # each stage announced when it begins, then reported with its duration
    assert names[1].endswith("loading the model")  # "building builtin:tiny (first use) and ..." on first use
    assert names[:1] + names[2:] == ["initialising the device", "measuring memory", "allocating the cache", "warming up"]
    assert all(seconds >= 0 for _, seconds in seen) and seen == st.done
    assert st.stage is None and w.state.value == "ready"
    failed: list[tuple[str, float | None]] = []
    bad = Startup(report=lambda stage, seconds: failed.append((stage, seconds)))
    with pytest.raises(Exception):
        preload(MLXWorker(Config(model="builtin:no-such-model", home=home)), startup=bad)
    assert bad.stage is None and [n for n, _ in bad.done] == ["initialising the device"]
    assert failed[-1][0] == "loading the model" and math.isnan(failed[-1][1])  # reported as failed


def test_the_stage_is_never_cleared_between_two_stages() -> None:
    # /readyz reads `stage` from the event loop while the preload thread reports (a write to
    # stderr lets the loop run): between two stages it must already name the next one.
    during: list[str | None] = []
    st = Startup()
    st.report = lambda stage, seconds: during.append(st.stage)
    st.begin("a")
    st.begin("b")  # reports "a" done, then "b" begun: "b" is the stage for both
    st.end()  # reports "b" done: the preload is over, nothing is starting any more
    assert during == ["a", "b", "b", None] and [n for n, _ in st.done] == ["a", "b"]


def test_generate_reports_a_failed_preload_instead_of_waiting(home: str, tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    with spawn("--preload", "--model", missing) as s:
        deadline = time.monotonic() + 60
        while not (body := _wait_for(s, "/readyz")[1]).get("preload_error"):
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        assert "starting" not in body  # the failed preload gave the lifecycle back
        out = subprocess.run([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "hello"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "preload failed" in out.stderr and "model" in out.stderr, out.stderr


def test_preload_sizes_the_pool_from_available_memory_not_the_machines_total(home: str, monkeypatch,
                                                                          tmp_path) -> None:
    from sidecar.worker import memory

    # Default limits (64 sequences of the model's full length): more than the fake machine can give.
    w = MLXWorker(Config(model="builtin:tiny", home=home, max_num_batched_tokens=64))
    avail = 48 << 20
    (tmp_path / "meminfo").write_text(f"MemAvailable: {avail // 1024} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    preload(w)
    assert w.state.value == "ready"
    want = -(-w.runner.max_model_len // w.config.block_size) * w.config.max_num_seqs
    assert 0 < w.runner.num_blocks < want  # the budget bound it, not the limits
    assert w.runner.pool.nbytes <= avail
