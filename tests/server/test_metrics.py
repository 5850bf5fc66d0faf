"""Metrics end to end (docs/operations.md, Metrics and alerts): a real server, real scrapes, promtool and a real Prometheus."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.client.remote import RemoteWorker
from sidecar.config import Config
from sidecar.server.metrics import Metrics
from sidecar.worker.mlx_worker import MLXWorker
from tests.driver import Driver
from tests.server.prom import Prometheus, need_tool, rpc_counts, samples, scrape, value
from tests.server.serverproc import finish, prefill, slow_prefill_tokens, start_server

TOKEN = "metrics-test-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MSGPACK = {"content-type": "application/msgpack", **AUTH}
BODY_LIMIT = 65536

# docs/operations.md, Metrics and alerts: every family, its type and its label names (prefix mlx_worker_).
GAUGES: dict[str, set[str]] = {
    "info": {"model", "dtype", "device", "mlx_version", "version"}, "state": {"state"}, "healthy": set(),
    "memory_active_bytes": set(), "memory_peak_bytes": set(), "memory_cache_bytes": set(),
    "memory_limit_bytes": set(), "memory_total_bytes": set(), "model_weights_bytes": set(),
    "kv_cache_blocks": set(), "kv_cache_blocks_used": set(), "kv_cache_usage_ratio": set(),
    "kv_cache_block_size_bytes": set(), "running_requests": set(), "last_step_duration_seconds": set(),
    "last_health_check_timestamp_seconds": set(), "start_time_seconds": {"instance_id"},
    "spec_decode_acceptance_ratio": set(),
}
COUNTERS = {"rpc_requests": {"method", "code"}, "prompt_tokens": set(), "generation_tokens": set(),
            "steps": set(), "errors": {"type"}, "prefill_chunks": set(), "pooling_requests": set(),
            "more_decode_steps": set(),
            "spec_decode_draft_tokens": set(), "spec_decode_accepted_tokens": set(),
            "mlx_thread_idle_seconds": set(),
            "encoder_runs": set(), "encoder_cache_hits": set(), "encoder_cache_misses": set(),
            "encoder_cache_evictions": set(), "encoder_seconds": set()}
HISTOGRAMS = {"rpc_duration_seconds": {"method"}, "step_duration_seconds": set(), "step_tokens": set(),
              "step_batch_size": set(), "time_to_first_token_seconds": set(),
              "spec_decode_draft_tokens_per_step": set()}


@pytest.fixture(scope="module")
def server(home: str, tmp_path_factory: pytest.TempPathFactory):
    flags = ["--preload", "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--max-model-len", "8192",
             "--max-body-bytes", str(BODY_LIMIT)]
    with start_server(*flags, env={"MLX_SIDECAR_AUTH_TOKEN": TOKEN}) as s:
        s.idle_metrics = httpx.get(f"{s.url}/metrics").text  # type: ignore[attr-defined]
        binary = shutil.which("prometheus")
        prom = Prometheus(binary, s.url.removeprefix("http://"), tmp_path_factory.mktemp("prometheus")) if binary else None
        s.prometheus = prom  # type: ignore[attr-defined]
        try:
            yield s
        finally:
            if prom is not None:
                prom.stop()


@pytest.fixture(scope="module")
def remote(server):
    w = RemoteWorker(server.url, token=TOKEN)
    yield w
    w.close()


def test_every_family_of_the_design_with_its_type_and_labels(server, remote: RemoteWorker) -> None:
    remote.check_health()
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 1024)
    d.add("fam", [5, 6, 7])
    d.step()
    d.finish("fam")
    d.step()
    httpx.post(f"{server.url}/rpc/load_model", headers=AUTH)  # a 409: errors_total gets a child
    families = {f.name: f for f in text_string_to_metric_families(scrape(server.url)) if f.name.startswith("mlx_worker_")}
    want = {**{n: ("gauge", ls) for n, ls in GAUGES.items()}, **{n: ("counter", ls) for n, ls in COUNTERS.items()},
            **{n: ("histogram", ls) for n, ls in HISTOGRAMS.items()}}
    assert sorted(families) == sorted("mlx_worker_" + n for n in want)
    for name, (kind, labels) in want.items():
        fam = families["mlx_worker_" + name]
        assert fam.type == kind, name
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == labels, (name, s)
    # The enum gauge: exactly one state is 1.
    states = {s.labels["state"]: s.value for s in families["mlx_worker_state"].samples}
    assert states["ready"] == 1 and sum(states.values()) == 1
    info = families["mlx_worker_info"].samples[0]
    assert info.value == 1 and info.labels["model"] == "builtin:tiny" and info.labels["dtype"] == "float32"


def test_the_alert_rules_reference_series_the_server_exposes(server) -> None:
    rules = (Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml").read_text()
    names = set(re.findall(r"mlx_worker_[a-z_]+", rules))
    assert names
    # Only a group's rank 0 exposes these (checked against a real group in tests/distributed/test_leader.py).
    names -= {"mlx_worker_rank_up", "mlx_worker_group_size"}
    exposed = {name for name, _ in samples(scrape(server.url))}
    assert names <= exposed, names - exposed


def test_promtool_accepts_the_real_output_idle_and_after_activity(server, remote: RemoteWorker) -> None:
    promtool = need_tool("promtool")
    # promtool really lints: a counter without the _total suffix is rejected.
    bad = subprocess.run([promtool, "check", "metrics"], input="# HELP foo x\n# TYPE foo counter\nfoo 1\n",
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 1024)
    d.add("lint", list(range(5, 40)), {"temperature": 0.0, "logprobs": 2})
    d.run(3)
    d.finish("lint")
    d.step()
    httpx.post(f"{server.url}/rpc/no_such_method", headers=AUTH)
    for text in (server.idle_metrics, scrape(server.url)):
        assert "mlx_worker_kv_cache_blocks" in text
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    # OpenMetrics, when asked for, is served too and ends with # EOF.
    om = httpx.get(f"{server.url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")


def test_rpc_requests_total_counts_every_call_including_rejected_ones(server) -> None:
    before = scrape(server.url)
    url = f"{server.url}/rpc"
    calls = [
        (("check_health", "200"), httpx.post(f"{url}/check_health", headers=AUTH)),
        (("check_health", "401"), httpx.post(f"{url}/check_health")),
        (("check_health", "401"), httpx.post(f"{url}/check_health", headers={"authorization": "Bearer wrong"})),
        (("unknown", "401"), httpx.post(f"{url}/no_such_method")),
        (("unknown", "404"), httpx.post(f"{url}/no_such_method", headers=AUTH)),
        (("unknown", "404"), httpx.post(f"{url}/__init__", headers=AUTH)),
        (("check_health", "405"), httpx.get(f"{url}/check_health", headers=AUTH)),
        (("load_model", "409"), httpx.post(f"{url}/load_model", headers=AUTH)),
        (("execute_model", "400"), httpx.post(f"{url}/execute_model", content=b"\xc1", headers=MSGPACK)),
        (("execute_model", "413"), httpx.post(f"{url}/execute_model", content=b"\x00" * (BODY_LIMIT + 1), headers=MSGPACK)),
        (("execute_model", "415"), httpx.post(f"{url}/execute_model", content=b"x", headers={"content-type": "text/plain", **AUTH})),
    ]
    for (method, code), r in calls:
        assert r.status_code == int(code), (method, code, r.text)
        assert r.headers["x-request-id"]
    after = scrape(server.url)
    want: dict[tuple[str, str], int] = {}
    for key, _ in calls:
        want[key] = want.get(key, 0) + 1
    b, a = rpc_counts(before), rpc_counts(after)
    got = {k: a[k] - b.get(k, 0.0) for k in a if a[k] != b.get(k, 0.0)}
    assert got == want
    # Every call is timed too, rejected ones included.
    for method in ("check_health", "unknown", "load_model", "execute_model"):
        n = sum(v for k, v in want.items() if k[0] == method)
        assert value(after, "mlx_worker_rpc_duration_seconds_count", method=method) - \
            value(before, "mlx_worker_rpc_duration_seconds_count", method=method) == n
    errors = {t: value(after, "mlx_worker_errors_total", type=t) - value(before, "mlx_worker_errors_total", type=t)
              for t in ("unauthorized", "unknown_method", "method_not_allowed", "invalid_state", "invalid_request",
                        "payload_too_large", "unsupported_media_type")}
    assert errors == {"unauthorized": 3, "unknown_method": 2, "method_not_allowed": 1, "invalid_state": 1,
                      "invalid_request": 1, "payload_too_large": 1, "unsupported_media_type": 1}


def test_step_metrics_and_scrape_time_gauges(server, remote: RemoteWorker) -> None:
    before = scrape(server.url)
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 1024)
    p, q = d.add("p", list(range(10, 30))), d.add("q", [7, 8, 9, 10, 11, 12, 13])
    d.step(16)  # p: 16 prompt tokens, no sample; q: 7 prompt tokens + its first token
    d.step(16)  # p: last 4 prompt tokens + first token; q: one decode
    d.step(16)  # two decodes
    mid = scrape(server.url)
    delta = {n: value(mid, n) - value(before, n) for n in (
        "mlx_worker_steps_total", "mlx_worker_prompt_tokens_total", "mlx_worker_generation_tokens_total",
        "mlx_worker_time_to_first_token_seconds_count", "mlx_worker_step_batch_size_sum",
        "mlx_worker_step_tokens_sum", "mlx_worker_step_duration_seconds_count", "mlx_worker_prefill_chunks_total")}
    assert delta == {"mlx_worker_steps_total": 3, "mlx_worker_prompt_tokens_total": 27,
                     "mlx_worker_generation_tokens_total": 5, "mlx_worker_time_to_first_token_seconds_count": 2,
                     "mlx_worker_step_batch_size_sum": 6, "mlx_worker_step_tokens_sum": 23 + 5 + 2,
                     "mlx_worker_step_duration_seconds_count": 3, "mlx_worker_prefill_chunks_total": 1}
    used = len(set(p.blocks) | set(q.blocks))
    assert value(mid, "mlx_worker_running_requests") == 2
    assert value(mid, "mlx_worker_kv_cache_blocks_used") == used == 11
    assert value(mid, "mlx_worker_kv_cache_usage_ratio") == pytest.approx(used / 1024)
    assert 0 < value(mid, "mlx_worker_last_step_duration_seconds") < 10
    d.finish("p")
    d.finish("q")
    d.step()  # only drops the requests: no forward pass, not a step
    after = scrape(server.url)
    assert value(after, "mlx_worker_running_requests") == 0
    assert value(after, "mlx_worker_kv_cache_blocks_used") == 0
    assert value(after, "mlx_worker_steps_total") == value(mid, "mlx_worker_steps_total")


def test_memory_and_model_gauges_match_the_worker(server, remote: RemoteWorker) -> None:
    text = scrape(server.url)
    info = httpx.get(f"{server.url}/info").json()
    assert value(text, "mlx_worker_kv_cache_blocks") == info["num_blocks"] == 1024
    assert value(text, "mlx_worker_kv_cache_block_size_bytes") == remote.get_cache_block_size_bytes()
    assert value(text, "mlx_worker_model_weights_bytes") == remote.get_model()["weights_bytes"] > 0
    pool = info["num_blocks"] * remote.get_cache_block_size_bytes()
    assert value(text, "mlx_worker_memory_active_bytes") >= pool  # the pool is allocated
    assert value(text, "mlx_worker_memory_peak_bytes") >= value(text, "mlx_worker_memory_active_bytes")
    assert value(text, "mlx_worker_memory_limit_bytes") > 0
    if info["device"] == "cpu":
        assert value(text, "mlx_worker_memory_total_bytes") == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    t = value(text, "mlx_worker_last_health_check_timestamp_seconds")
    remote.check_health()
    assert t < value(scrape(server.url), "mlx_worker_last_health_check_timestamp_seconds") <= time.time()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prometheus-client's process metrics read /proc")
def test_process_metrics(server) -> None:
    text = scrape(server.url)
    fds = len(os.listdir(f"/proc/{server.pid}/fd"))
    assert abs(value(text, "process_open_fds") - fds) <= 5
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    assert 0.5 < value(text, "process_resident_memory_bytes") / (rss_kb * 1024) < 2
    assert value(text, "process_cpu_seconds_total") > 0
    assert value(text, "process_max_fds") > 0


def _scraped(prom: Prometheus) -> bool:
    try:
        return bool(prom.query("up"))
    except httpx.TransportError:
        return False


def test_a_scrape_never_waits_for_a_running_step(server, remote: RemoteWorker) -> None:
    """One execute_model of seconds (a long prefill on builtin:tiny: ~2.5 s on a 2-core x86
    CPU); /metrics, /healthz and /readyz keep answering in < 100 ms throughout, and the live
    memory gauge shows the step's activations while it runs."""
    execute = lambda so: remote.call("execute_model", scheduler_output=so)  # noqa: E731
    n = slow_prefill_tokens(execute, 2.5, 6144)
    prom: Prometheus | None = server.prometheus
    if prom is not None:  # let the real Prometheus scrape during the step too (checked in the last test)
        deadline = time.monotonic() + 20
        while not _scraped(prom) and time.monotonic() < deadline:
            time.sleep(0.1)
    idle_active = value(scrape(server.url), "mlx_worker_memory_active_bytes")
    done: dict = {}

    def step() -> None:
        w = RemoteWorker(server.url, token=TOKEN)
        t0, wall0 = time.monotonic(), time.time()
        done["out"] = w.execute_model(prefill("slow", n))
        done["t"] = (t0, time.monotonic())
        server.slow_step = (wall0, time.time())
        w.close()

    th = threading.Thread(target=step)
    th.start()
    timings: list[tuple[float, float, str, float]] = []  # (start, seconds, path, active memory)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        deadline = time.monotonic() + 10
        while not c.get("/info").json()["busy"]:
            assert time.monotonic() < deadline and th.is_alive(), "the step never started"
            time.sleep(0.005)
        while th.is_alive():
            for path in ("/metrics", "/healthz", "/readyz"):
                t0 = time.monotonic()
                r = c.get(path)
                dt = time.monotonic() - t0
                assert r.status_code == 200, (path, r.text)
                active = value(r.text, "mlx_worker_memory_active_bytes") if path == "/metrics" else 0.0
                timings.append((t0, dt, path, active))
            time.sleep(0.05)
    th.join()
    remote.execute_model(finish("slow"))
    start, end = done["t"]
    assert done["out"].req_ids == ["slow"]
    if end - start < 1.0:
        pytest.skip(f"this device runs a {n}-token prefill in {end - start:.2f}s: too fast to test against")
    during = [t for t in timings if t[0] + t[1] < end]
    assert len([t for t in during if t[2] == "/metrics"]) >= 5, timings
    worst = max(during, key=lambda t: t[1])
    # Waiting on the step would take seconds; the bound leaves room for a loaded 2-core machine,
    # where the server's event loop shares the cores with the step's MLX threads.
    assert worst[1] < 0.3, f"{worst[2]} took {worst[1] * 1e3:.0f} ms during a {end - start:.1f}s step"
    # The memory gauges are read live: the step's attention scores show up mid-step.
    assert max(t[3] for t in during) > idle_active + 10 * 2**20


class _Exploding:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a scrape read runner.{name}")


def test_scrape_reads_only_the_published_snapshot(make_worker) -> None:
    """The collector never touches the runner (which the MLX thread mutates): it reads the snapshot
    published after each call, so a scrape during a step sees the state before it."""
    w = make_worker(num_blocks=64)
    m = Metrics(CollectorRegistry(), lambda: w, process=False)
    m.publish(w)
    runner, w.runner = w.runner, _Exploding()  # type: ignore[assignment]
    try:
        text = generate_latest(m.registry).decode()
    finally:
        w.runner = runner
    assert value(text, "mlx_worker_kv_cache_blocks") == 64
    assert value(text, "mlx_worker_state", state="cache_ready") == 1
    # A worker that has not even picked a device scrapes fine too.
    fresh = MLXWorker(Config())
    m2 = Metrics(CollectorRegistry(), lambda: fresh, process=False)
    m2.publish(fresh)
    text = generate_latest(m2.registry).decode()
    assert value(text, "mlx_worker_state", state="created") == 1 and value(text, "mlx_worker_kv_cache_blocks") == 0


def test_metrics_stay_open_without_the_token_and_info_too(server) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/info").status_code == 200
    assert httpx.post(f"{server.url}/rpc/check_health", content=msgpack.packb({}),
                      headers={"content-type": "application/msgpack"}).status_code == 401


def test_prometheus_scrapes_the_sidecar(server) -> None:
    """Runs last: the module's Prometheus has scraped every second since the server started,
    through the long step above too, and never missed or waited."""
    need_tool("prometheus")
    prom: Prometheus = server.prometheus
    num_blocks = httpx.get(f"{server.url}/info").json()["num_blocks"]
    deadline = time.monotonic() + 30
    while True:
        assert prom.proc.poll() is None, prom.log()
        try:
            result = prom.query("mlx_worker_kv_cache_blocks")
        except httpx.TransportError:
            result = []
        if result:
            break
        assert time.monotonic() < deadline, prom.log()
        time.sleep(0.2)
    assert result[0]["metric"]["job"] == "mlx-sidecar" and result[0]["metric"]["instance"] == prom.target
    assert float(result[0]["value"][1]) == num_blocks
    assert prom.scalar('mlx_worker_state{state="ready"}') == 1
    info = prom.query("mlx_worker_info")
    assert len(info) == 1 and info[0]["metric"]["model"] == "builtin:tiny" and info[0]["metric"]["device"]
    # Every scrape succeeded, quickly, including those Prometheus made during the long step (waiting
    # on it would take seconds; the bound is the in-test scrapes', room for a loaded 2-core machine).
    assert prom.scalar('min_over_time(up{job="mlx-sidecar"}[5m])') == 1
    assert prom.scalar('max_over_time(scrape_duration_seconds{job="mlx-sidecar"}[5m])') < 0.3
    start, end = getattr(server, "slow_step", (0.0, 0.0))
    if end - start >= 3:
        window = f"[{int(end - start) - 1}s]"
        at = {"time": f"{end - 0.5:.3f}"}
        r = httpx.get(f"{prom.api}/query", params={"query": f'count_over_time(up{{job="mlx-sidecar"}}{window})', **at}).json()
        assert float(r["data"]["result"][0]["value"][1]) >= 2, r
        r = httpx.get(f"{prom.api}/query", params={
            "query": f'max_over_time(scrape_duration_seconds{{job="mlx-sidecar"}}{window})', **at}).json()
        assert float(r["data"]["result"][0]["value"][1]) < 0.3, r
    targets = httpx.get(f"{prom.api}/targets").json()["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"] and targets[0]["lastError"] == ""


def test_the_published_snapshot_is_a_full_rebuild_after_every_call(make_worker, monkeypatch) -> None:
    """Between steps only the usage fields are recomputed (Snapshot.static_key): the result equals
    a full Snapshot.of after steps, a new pool, sleep and wake, shutdown and a fresh start."""
    from sidecar.scheduler import Request, Scheduler, run
    from sidecar.server.metrics import Snapshot

    w = make_worker(num_blocks=64)
    m = Metrics(CollectorRegistry(), lambda: w, process=False)
    full = []
    of = Snapshot.of
    monkeypatch.setattr(Snapshot, "of", classmethod(lambda cls, w: full.append(1) or of(w)))

    def publish_and_check() -> None:
        m.publish(w)
        assert m.snapshot == of(w)

    publish_and_check()
    sched = Scheduler(num_blocks=64, block_size=w.config.block_size, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(Request("a", list(range(5, 25)), {"temperature": 0.0}, max_tokens=6, ignore_eos=True))
    seen = []

    def step(so: dict) -> dict:
        out = w.execute_model(so).to_wire()
        publish_and_check()
        seen.append(m.snapshot.blocks_used)
        return out

    run(sched, step)
    assert len(full) == 1  # the steps only refreshed usage
    assert max(seen) >= 2 and seen[-1] == 0  # (it did move: the request held blocks, then none)
    for call in (lambda: w.initialize_cache(32, 0), lambda: w.sleep(1), lambda: w.wake_up(None),
                 lambda: w.sleep(2), lambda: w.wake_up(None), w.shutdown, w.init_device, w.load_model,
                 lambda: w.initialize_cache(16, 0)):
        call()
        publish_and_check()
    assert m.snapshot.num_blocks == 16 and len(full) > 1
