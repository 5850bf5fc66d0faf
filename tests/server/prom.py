"""Reading the sidecar's metrics in tests: scrapes parsed with prometheus-client's own parser,
and a real Prometheus scraping a server."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.serverproc import free_port


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (scripts/ensure-prometheus.sh)")
    return path


class Prometheus:
    """A real Prometheus scraping one target every second (its scrape manager only starts ~5 s
    after launch, so the module starts it with the server and queries it in the last test)."""

    def __init__(self, binary: str, target: str, workdir: Path):
        self.port, self.target, self.workdir = free_port(), target, workdir
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        (workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            f"scrape_configs:\n  - job_name: mlx-sidecar\n    static_configs:\n      - targets: ['{target}']\n")
        with open(workdir / "prometheus.log", "wb") as logf:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text()

    def query(self, q: str) -> list:
        r = httpx.get(f"{self.api}/query", params={"query": q}, timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        return r.json()["data"]["result"]

    def scalar(self, q: str) -> float:
        result = self.query(q)
        assert len(result) == 1, (q, result)
        return float(result[0]["value"][1])

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def scrape(url: str) -> str:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def rpc_counts(text: str) -> dict[tuple[str, str], float]:
    return {(dict(k[1])["method"], dict(k[1])["code"]): v for k, v in samples(text).items()
            if k[0] == "mlx_worker_rpc_requests_total"}
