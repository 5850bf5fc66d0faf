"""Start a real `python -m sidecar serve ...` subprocess on a free port (or a Unix socket), wait
until it answers, stop it with a real signal.

    with start_server("--preload", env={"MLX_SIDECAR_AUTH_TOKEN": "t"}) as s:
        httpx.get(f"{s.url}/metrics")             # s.url: http://127.0.0.1:<port> or unix:///path
        RemoteWorker(s.url, token="t").check_health()
    # stopped (SIGTERM, then SIGKILL after a timeout); s.returncode, s.stderr() stay readable

The built-in models are found through MLX_SIDECAR_HOME: request the session `home` fixture
(tests/conftest.py), which sets it, before starting a server.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Callable, Mapping
from urllib.parse import urlparse

import httpx

from sidecar.client.http1 import Connection

ROOT = Path(__file__).resolve().parents[2]


def server_python() -> str:
    """The interpreter that runs the server: this one, or $MLX_SIDECAR_PYTHON (the vLLM suite runs
    without MLX and starts the server from the main .venv)."""
    return os.environ.get("MLX_SIDECAR_PYTHON") or sys.executable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """The server process ended before it was ready (the message carries its stderr)."""


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, workdir: Path, uds: str | None = None):
        self.proc = proc
        self.url = url  # http://127.0.0.1:PORT, or unix:///path for --uds
        self.uds = uds
        self.workdir = workdir
        self.stderr_path = workdir / "stderr.log"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def stderr(self) -> str:
        """Everything the server wrote to stderr so far (its logs)."""
        return self.stderr_path.read_text(errors="replace")

    def client(self, **kwargs: object) -> httpx.Client:
        """An httpx client for this server (TCP or Unix socket); requests take paths, e.g. "/metrics"."""
        kwargs.setdefault("timeout", 60.0)
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://sidecar", **kwargs)  # type: ignore[arg-type]
        return httpx.Client(base_url=self.url, **kwargs)  # type: ignore[arg-type]

    def http_url(self) -> str:
        """The URL httpx/urllib can use directly (TCP servers only)."""
        if self.uds:
            raise ValueError("a Unix socket server has no http URL; use .client()")
        return self.url

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; returns its exit status (raises subprocess.TimeoutExpired)."""
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait; SIGKILL after `timeout`. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _has_flag(flags: tuple[str, ...], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


# Start-up shapes for a test's server unless its flags name them: the profile run and warm-up at
# the defaults (a 2048-token prefill, 64 decode rows) cost seconds per server on a CPU and exercise
# nothing a test checks with a few short requests (steps up to max_model_len are still accepted).
TEST_SHAPES = {"--max-num-batched-tokens": "256", "--max-num-seqs": "8"}


def spawn(*flags: str, env: Mapping[str, str | None] | None = None) -> Server:
    """Start `python -m sidecar serve <flags>` without waiting for it. A free `--port` is added
    unless the flags give `--port` or `--uds`, and TEST_SHAPES unless they give their own. `env`
    entries override the inherited environment (None removes a variable)."""
    workdir = Path(tempfile.mkdtemp(prefix="sidecar-server-"))
    atexit.register(shutil.rmtree, workdir, True)
    args = list(flags)
    for flag, value in TEST_SHAPES.items():
        if not _has_flag(flags, flag):
            args += [flag, value]
    uds = None
    if _has_flag(flags, "--uds"):
        i = next(i for i, f in enumerate(flags) if f.startswith("--uds"))
        uds = flags[i].split("=", 1)[1] if "=" in flags[i] else flags[i + 1]
        url = f"unix://{uds}"
    else:
        if not _has_flag(flags, "--port"):
            args += ["--port", str(free_port())]
        i = next(i for i, f in enumerate(args) if f.startswith("--port"))
        port = args[i].split("=", 1)[1] if "=" in args[i] else args[i + 1]
        url = f"http://127.0.0.1:{port}"
    full_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    with open(workdir / "stderr.log", "wb") as err, open(workdir / "stdout.log", "wb") as out:
        proc = subprocess.Popen([server_python(), "-m", "sidecar", "serve", *args], cwd=ROOT, env=full_env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    return Server(proc, url, workdir, uds)


def _probe(server: Server, path: str) -> tuple[int, bytes] | None:
    """GET path with the standard library (closing the socket whatever happens); None if refused."""
    u = urlparse(server.url)
    conn = Connection(timeout=5, uds=server.uds) if server.uds else Connection("127.0.0.1", u.port or 80, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def start_server(*flags: str, env: Mapping[str, str | None] | None = None, ready: bool | None = None,
                 timeout: float = 120.0) -> Server:
    """Spawn a server and wait until `/healthz` answers (and `/readyz`, when `ready` or, by
    default, when `--preload` is among the flags). Raises ServerExited with the server's stderr
    if it dies first. Use as a context manager, or call `.stop()`."""
    server = spawn(*flags, env=env)
    want_ready = _has_flag(flags, "--preload") if ready is None else ready
    path = "/readyz" if want_ready else "/healthz"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if server.proc.poll() is not None:
                raise ServerExited(f"server exited with {server.proc.returncode} before {path} answered:\n{server.stderr()}")
            answer = _probe(server, path)
            if answer is not None:
                status, body = answer
                if status == 200:
                    return server
                if path == "/readyz" and json.loads(body).get("preload_error"):
                    raise ServerExited(f"preload failed: {json.loads(body)['preload_error']}\n{server.stderr()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not answer 200 within {timeout}s:\n{server.stderr()}")
            time.sleep(0.05)
    except BaseException:
        server.stop(timeout=10)
        raise


# --- scheduler outputs for tests that need a particular step ----------------------------------


def prefill(req_id: str, n: int, *, first_block: int = 0, block_size: int = 16, token: int = 5) -> dict:
    """A SchedulerOutput with one new request computing all `n` prompt tokens in one step (blocks
    first_block .. first_block + ceil(n / block_size) - 1): a step whose cost grows ~ n**2."""
    blocks = list(range(first_block, first_block + -(-n // block_size)))
    return {"scheduled_new_reqs": [{"req_id": req_id, "prompt_token_ids": [token] * n, "sampling_params": {"temperature": 0.0},
                                    "block_ids": [blocks], "num_computed_tokens": 0, "lora_request": None}],
            "num_scheduled_tokens": {req_id: n}, "total_num_scheduled_tokens": n}


def finish(*req_ids: str) -> dict:
    """A SchedulerOutput that only drops requests."""
    return {"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
            "finished_req_ids": list(req_ids)}


def slow_prefill_tokens(execute: Callable[[dict], object], seconds: float, max_tokens: int) -> int:
    """How many prompt tokens make one prefill step take about `seconds` on this machine: times a
    1024-token step and extrapolates (attention makes the cost ~ n**1.9 here), capped at max_tokens.
    `execute(scheduler_output)` runs a step on the server under test. The faster of two probes: a
    cold first step (or a busy moment) would make the step asked for shorter than `seconds`."""
    probe, dt = 1024, float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        execute(prefill("calibrate", probe))
        dt = min(dt, time.perf_counter() - t0)
        execute(finish("calibrate"))
    return max(probe, min(max_tokens, int(probe * (seconds / max(dt, 1e-3)) ** (1 / 1.9))))
