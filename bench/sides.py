"""The two sides of the benchmark.

Sidecar: a real `python -m sidecar serve` subprocess, driven over HTTP by the reference scheduler
through `TimedWorker` (a RemoteWorker that also records, per execute_model call, the client-observed
time and the server's own execution time). mlx-lm: the same model directory loaded in this process,
run with `stream_generate` (one request) and `BatchGenerator` (many). Greedy and eos ignored on both
sides, so every request generates exactly the tokens asked for.
"""

from __future__ import annotations

import http.client
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from sidecar.client.remote import RemoteWorker
from sidecar.client.pipeline import Pipeline
from sidecar.scheduler import Event, Request, Scheduler, run
from sidecar.scheduler.pipelined import run_pipelined

perf = time.perf_counter
_ids = itertools.count()


def fresh_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


# ---------------------------------------------------------------- the server subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m sidecar serve` on a free loopback port; stopped with SIGTERM (then SIGKILL) by pid."""

    def __init__(self, model: str, home: str | None, *, extra: dict[str, Any] | None = None,
                 log_dir: str | None = None, env: dict[str, str] | None = None):
        self.model, self.home = model, home
        self.extra = dict(extra or {})
        self.env = dict(env or {})  # on top of this process's environment (e.g. a BLAS preload)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="sidecar-bench-")) / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "sidecar", "serve", "--port", str(self.port), "--model", self.model,
                "--log-level", "warning"]
        if self.home:
            argv += ["--home", self.home]
        for k, v in self.extra.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        return argv

    def start(self, timeout: float = 120.0) -> ServerProcess:
        log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("MLX_SIDECAR_AUTH_TOKEN", None)  # the bench talks to its own loopback servers
        env.update(self.env)
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sidecar server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/healthz")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the sidecar server did not answer /healthz within {timeout:g}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# ---------------------------------------------------------------- a RemoteWorker that times its calls


@dataclass
class StepRecord:
    tag: str  # the scenario that sent it
    rows: int  # requests scheduled
    tokens: int  # total_num_scheduled_tokens
    decode: bool  # every row computes exactly one token and none is new
    client_s: float  # the whole call as the scheduler sees it: encode, HTTP round trip, decode
    server_s: float | None  # the server's own time for it (None: unknown)


_GAUGE = re.compile(rb"^mlx_worker_last_step_duration_seconds\s+([0-9.eE+-]+)\s*$", re.M)


class TimedWorker(RemoteWorker):
    """RemoteWorker that times each execute_model twice: as the client sees it, and as the server
    reports it (`Server-Timing: exec;dur=<ms>`, the call's time on the MLX thread, which RemoteWorker
    keeps as `last_exec_seconds`). A server without the header: while `probe` is on, its time is read
    from the `mlx_worker_last_step_duration_seconds` gauge on /metrics after the call instead
    (runner.execute_model alone: it leaves out the wire validation and the result's to_wire)."""

    def __init__(self, url: str, timeout: float = 1800.0):
        super().__init__(url, timeout=timeout)
        self.records: list[StepRecord] = []
        self.tag = ""
        self.probe = False
        self.header_seen: bool | None = None  # unknown until the first execute_model
        self._metrics_conn: http.client.HTTPConnection | None = None

    def step(self, scheduler_output: dict) -> dict:
        """execute_model for the scheduler's `run`: the raw wire result, timed."""
        t0 = perf()
        result = self.call("execute_model", scheduler_output=scheduler_output)
        client = perf() - t0
        server = self.last_exec_seconds
        if self.header_seen is None:
            self.header_seen = server is not None
        nst = scheduler_output["num_scheduled_tokens"]
        tokens = scheduler_output["total_num_scheduled_tokens"]
        if server is None and self.probe and tokens:
            server = self.last_step_gauge()  # the gauge only moves on steps that ran a forward pass
        self.records.append(StepRecord(self.tag, len(nst), tokens,
                                       bool(nst) and tokens == len(nst) and not scheduler_output["scheduled_new_reqs"],
                                       client, server))
        return result

    def last_step_gauge(self) -> float | None:
        return self._scrape(_GAUGE)

    def idle_seconds(self) -> float | None:
        """The server's MLX thread idle time (/info `mlx_thread_idle_seconds`, cheaper than a
        scrape; None: a server without it)."""
        value = self.info().get("mlx_thread_idle_seconds")
        return float(value) if isinstance(value, (int, float)) else None

    def ahead_counts(self) -> tuple[int, int] | None:
        """The server runner's decode-ahead (hits, misses), rows counted (/info `decode_ahead`)."""
        got = self.info().get("decode_ahead")
        return (int(got["hits"]), int(got["misses"])) if isinstance(got, dict) else None

    def _scrape(self, pattern: re.Pattern[bytes]) -> float | None:
        u = urlparse(self.url)
        for attempt in (0, 1):
            if self._metrics_conn is None:
                self._metrics_conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=30)
            try:
                self._metrics_conn.request("GET", "/metrics")
                data = self._metrics_conn.getresponse().read()
                break
            except (OSError, http.client.HTTPException):
                self._metrics_conn.close()
                self._metrics_conn = None
                if attempt:
                    return None
        m = pattern.search(data)
        return float(m.group(1)) if m else None

    def close(self) -> None:
        super().close()
        if self._metrics_conn is not None:
            self._metrics_conn.close()
            self._metrics_conn = None


# ---------------------------------------------------------------- the sidecar side


@dataclass
class RunResult:
    wall_s: float
    tokens: dict[str, list[int]]  # generated tokens per request id, in submission order
    first_token_s: dict[str, float]  # since the run started
    token_times: dict[str, list[float]] = field(default_factory=dict)  # since the run started

    @property
    def total_tokens(self) -> int:
        return sum(map(len, self.tokens.values()))


class SidecarSide:
    """One server process, brought to cache_ready, and runs of the reference scheduler against it."""

    def __init__(self, server: ServerProcess, num_blocks: int, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.server = server
        self.worker = TimedWorker(server.url)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.num_blocks = 0
        self.block_size = 16
        self.eos: list[int] = []
        self.bring_up_s: dict[str, float] = {}
        self._pipe: Pipeline | None = None
        self._bring_up(num_blocks)

    def _bring_up(self, num_blocks: int) -> None:
        # init_device -> load_model -> initialize_cache; execute_model is allowed in cache_ready.
        # determine_available_memory and compile_or_warm_up_model are skipped: each runs a profile
        # forward at max_num_batched_tokens x max_num_seqs (over a minute each on 2 CPU cores); the
        # bench warms up with its own steps instead.
        w = self.worker
        t0 = perf()
        w.init_device()
        w.load_model()
        self.bring_up_s["init_and_load"] = perf() - t0
        self.eos = list(w.get_model().get("eos_token_ids") or [])
        self.initialize_cache(num_blocks)

    def initialize_cache(self, num_blocks: int) -> float:
        t0 = perf()
        self.worker.initialize_cache(num_gpu_blocks=num_blocks)
        info = self.worker.info()
        self.num_blocks, self.block_size = info["num_blocks"], info["block_size"]
        dt = perf() - t0
        self.bring_up_s[f"initialize_cache_{num_blocks}"] = dt
        return dt

    def block_bytes(self) -> int:
        return int(self.worker.get_cache_block_size_bytes())

    def run(self, requests: list[Request], *, tag: str, max_num_seqs: int | None = None,
            on_event: Callable[[Event, float], None] | None = None, scheduler: Scheduler | None = None,
            probe: bool = False, take_drafts: bool = False, pipelined: int = 0,
            decode_steps: int = 1) -> tuple[RunResult, Scheduler]:
        sched = scheduler or Scheduler(
            num_blocks=self.num_blocks, block_size=self.block_size, max_num_seqs=max_num_seqs or self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, eos_token_ids=self.eos, num_decode_steps=decode_steps)
        # take_drafts: the server's proposer drafts (take_draft_token_ids after each step), as vLLM's engine does.
        for r in requests:
            sched.add_request(r)
        tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
        first: dict[str, float] = {}
        times: dict[str, list[float]] = {r.req_id: [] for r in requests}
        self.worker.tag, self.worker.probe = tag, probe
        t0 = perf()

        def event(e: Event) -> None:
            now = perf() - t0
            tokens[e.req_id] += e.new_token_ids
            times[e.req_id] += [now] * len(e.new_token_ids)  # (an event may bring several)
            first.setdefault(e.req_id, now)
            if on_event is not None:
                on_event(e, now)

        try:
            if pipelined:  # two steps in flight over `pipelined` connections (no per-step records)
                pipe = self.pipeline(pipelined)
                run_pipelined(sched, lambda so: pipe.submit("execute_model", scheduler_output=so), pipe.collect,
                              on_event=event)
            else:
                run(sched, self.worker.step, on_event=event,
                    take_draft_token_ids=self.worker.take_draft_token_ids if take_drafts else None)
        finally:
            self.worker.probe = False
        return RunResult(perf() - t0, tokens, first, times), sched

    def pipeline(self, connections: int) -> Pipeline:
        if self._pipe is None or len(self._pipe._conns) != (connections if connections == 2 else 0):
            if self._pipe is not None:
                self._pipe.close()
            self._pipe = Pipeline(self.server.url, connections=connections)
        return self._pipe

    def close(self) -> None:
        self.worker.close()
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None


def requests_for(prompts: list[list[int]], new_tokens: int | list[int], sampling: list[dict] | dict | None = None,
                 prefix: str = "r") -> list[Request]:
    n = len(prompts)
    news = new_tokens if isinstance(new_tokens, list) else [new_tokens] * n
    samp = sampling if isinstance(sampling, list) else [sampling or {"temperature": 0.0}] * n
    return [Request(fresh_id(prefix), list(p), dict(s), max_tokens=m, ignore_eos=True)
            for p, m, s in zip(prompts, news, samp, strict=True)]


# ---------------------------------------------------------------- the mlx-lm side


class MlxLmSide:
    """mlx-lm on the same model directory, in this process; eos ignored, greedy."""

    def __init__(self, path: Path):
        import mlx_lm

        t0 = perf()
        self.model, self.tokenizer = mlx_lm.load(str(path))
        self.tokenizer.eos_token_ids = []  # generate exactly max_tokens, as the sidecar side does
        self.load_s = perf() - t0

    def single(self, prompt: list[int], new_tokens: int) -> RunResult:
        """stream_generate: per-token timestamps (the first one marks the end of prefill)."""
        from mlx_lm import stream_generate

        toks: list[int] = []
        times: list[float] = []
        t0 = perf()
        for r in stream_generate(self.model, self.tokenizer, prompt, max_tokens=new_tokens):
            times.append(perf() - t0)
            toks.append(int(r.token))
        return RunResult(perf() - t0, {"0": toks}, {"0": times[0]}, {"0": times})

    def batch(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> RunResult:
        """BatchGenerator (continuous batching) with at most `concurrency` sequences generating."""
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(self.model, max_tokens=new_tokens, stop_tokens=None,
                             completion_batch_size=concurrency, prefill_batch_size=min(8, concurrency))
        try:
            t0 = perf()
            uids = gen.insert([list(p) for p in prompts], [new_tokens] * len(prompts))
            tokens: dict[Any, list[int]] = {u: [] for u in uids}
            first: dict[Any, float] = {}
            while responses := gen.next_generated():
                now = perf() - t0
                for r in responses:
                    tokens[r.uid].append(int(r.token))
                    first.setdefault(r.uid, now)
            wall = perf() - t0
        finally:
            gen.close()
            mx.clear_cache()
        return RunResult(wall, {str(u): tokens[u] for u in uids}, {str(u): first[u] for u in uids if u in first})
