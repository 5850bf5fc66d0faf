"""Rank 0's probes while the group forms.

mx.distributed.init on rank 0 waits, without a timeout, until every rank has joined: at the first
start, and after every restart that followed a lost rank. Meanwhile this stand-in answers on
rank 0's port, so the service stays observable: /healthz 200, /readyz 503 (state "forming", the
ranks not joined yet), /metrics (mlx_worker_healthy 0, mlx_worker_rank_up per rank), and 503 with
Retry-After to every RPC. It closes before the real server binds the same port.

It runs as a small child process: mx.distributed.init holds the GIL while it waits, so no thread of
rank 0 could answer. The child exits when stopped or when its parent is gone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from sidecar.config import Config

log = logging.getLogger("sidecar.distributed")


def _metrics(size: int) -> bytes:
    class Forming:
        def collect(self):  # type: ignore[no-untyped-def]
            yield GaugeMetricFamily("mlx_worker_healthy", "1 when the last health check passed", value=0.0)
            up = GaugeMetricFamily("mlx_worker_rank_up", "1 while the rank answers the group's collectives",
                                   labels=["rank"])
            for r in range(size):
                up.add_metric([str(r)], 1.0 if r == 0 else 0.0)
            yield up
            yield GaugeMetricFamily("mlx_worker_group_size", "Ranks in the mx.distributed group", value=size)

    registry = CollectorRegistry()
    registry.register(Forming())  # type: ignore[arg-type]
    return generate_latest(registry)


def _handler(size: int, protect_metrics: bool) -> type[BaseHTTPRequestHandler]:
    waiting = f"the group is forming: waiting in mx.distributed.init for ranks 1..{size - 1} to join"
    ready = json.dumps({"ready": False, "state": "forming", "healthy": False, "draining": False,
                        "group": {"world_size": size, "lost": waiting,
                                  "ranks": {str(r): r == 0 for r in range(size)}}}).encode()
    envelope = {"error": {"type": "unavailable", "message": waiting, "field": None}}
    error, error_msgpack = json.dumps(envelope).encode(), msgpack.packb(envelope)
    metrics = None if protect_metrics else _metrics(size)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            if status == 503:
                self.send_header("retry-after", "5")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path == "/healthz":
                self._send(200, b'{"status": "ok"}')
            elif self.path == "/metrics" and metrics is not None:
                self._send(200, metrics, "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(503, ready if self.path == "/readyz" else error)

        def do_POST(self) -> None:  # noqa: N802
            # The reply in the request's format, as the real server answers (RemoteWorker sends msgpack).
            kinds = (self.headers.get("accept", "") + self.headers.get("content-type", "")).lower()
            if "msgpack" in kinds:
                self._send(503, error_msgpack, "application/msgpack")
            else:
                self._send(503, error)

        def log_message(self, format: str, *args: object) -> None:  # quiet, as the real server
            pass

    return Handler


class FormingServer:
    def __init__(self, config: Config):
        self.config = config
        self._proc: subprocess.Popen | None = None

    def start(self) -> FormingServer:
        cfg = self.config
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.distributed.forming", cfg.host, str(cfg.port), str(cfg.world_size),
             "1" if cfg.protect_metrics else "0"], stdin=subprocess.DEVNULL)
        log.info("rank 0: waiting for the group; probes on %s:%d meanwhile", cfg.host, cfg.port)
        return self

    def stop(self) -> None:
        p, self._proc = self._proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def main(argv: list[str]) -> int:
    host, port, size, protect = argv[0], int(argv[1]), int(argv[2]), argv[3] == "1"
    try:
        server = ThreadingHTTPServer((host, port), _handler(size, protect))
    except OSError as e:  # the real server will report the port itself
        print(f"mlx-sidecar: no probes while the group forms: {e}", file=sys.stderr)
        return 0
    server.daemon_threads = True
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        server.shutdown()

    threading.Thread(target=watch_parent, daemon=True).start()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
