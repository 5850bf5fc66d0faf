"""Structured logs of real servers: one line per RPC with method, status, duration and request id
(echoed in X-Request-Id), in JSON or text; nothing per RPC at the default level."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest
from starlette.testclient import TestClient

from sidecar.config import Config
from sidecar.server.app import create_app
from sidecar.server.logs import JsonFormatter, TextFormatter, add_secret
from sidecar.worker.mlx_worker import MLXWorker
from tests.server.serverproc import start_server


def calls(url: str) -> list[tuple[httpx.Response, str, int]]:
    """(response, method label, status) for a mix of good and bad calls."""
    with httpx.Client(base_url=url) as c:
        return [
            (c.post("/rpc/check_health", headers={"x-request-id": "req-abc-123"}), "check_health", 200),
            (c.post("/rpc/check_health"), "check_health", 200),
            (c.post("/rpc/init_device", json={"bogus": 1}), "init_device", 400),
            (c.post("/rpc/load_model"), "load_model", 409),
            (c.post("/rpc/no_such_method", headers={"x-request-id": "has spaces in it"}), "unknown", 404),
            (c.post("/rpc/check_health", headers={"x-request-id": "x" * 200}), "check_health", 200),
            (c.get("/rpc/check_health"), "check_health", 405),
        ]


def check_ids(results: list[tuple[httpx.Response, str, int]]) -> None:
    for r, _, status in results:
        assert r.status_code == status, r.text
    ids = [r.headers["x-request-id"] for r, _, _ in results]
    assert ids[0] == "req-abc-123"  # an incoming id is reused
    for i in (1, 2, 3, 4, 5, 6):  # generated, also replacing the unsafe or oversized incoming ones
        assert re.fullmatch(r"[0-9a-f]{16}", ids[i]), ids[i]
    assert len(set(ids)) == len(ids)


def wait_for_lines(server, n: int) -> list[str]:
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in server.stderr().splitlines() if line.strip()]
        if len([x for x in lines if "rpc" in x]) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_json_lines_carry_method_status_duration_and_request_id(home: str) -> None:
    with start_server("--log-format", "json", "--log-level", "info") as s:
        results = calls(s.url)
        check_ids(results)
        lines = wait_for_lines(s, len(results))
    records = [json.loads(line) for line in lines]  # every line is JSON, uvicorn's included
    assert any(x["logger"].startswith("uvicorn") for x in records)
    rpc_lines = [x for x in records if x["msg"] == "rpc"]
    assert len(rpc_lines) == len(results)
    by_id = {x["request_id"]: x for x in rpc_lines}
    for r, method, status in results:
        x = by_id[r.headers["x-request-id"]]
        assert x["method"] == method and x["status"] == status and x["logger"] == "sidecar.rpc"
        assert isinstance(x["duration_ms"], float) and 0 <= x["duration_ms"] < 10_000
        assert x["level"] == "info" and isinstance(x["ts"], float)
        assert ("error" in x) == (status != 200)
    assert by_id[results[4][0].headers["x-request-id"]]["error"] == "unknown_method"


def test_text_lines_carry_the_same_fields(home: str) -> None:
    with start_server("--log-format", "text", "--log-level", "info") as s:
        results = calls(s.url)
        check_ids(results)
        lines = wait_for_lines(s, len(results))
    pattern = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d info sidecar\.rpc: rpc (.*)")
    fields = [dict(kv.split("=", 1) for kv in m.group(1).split()) for line in lines if (m := pattern.fullmatch(line))]
    assert len(fields) == len(results)
    for (r, method, status), f in zip(results, fields):
        assert f["request_id"] == r.headers["x-request-id"] and f["method"] == method and f["status"] == str(status)
        assert float(f["duration_ms"]) >= 0
    assert "color_message" not in "\n".join(lines)  # uvicorn's terminal-only extra is dropped


def test_quiet_by_default(home: str) -> None:
    """Level warning: no start-up chatter, no line for successes or client errors."""
    with start_server() as s:
        results = calls(s.url)
        for r, _, status in results:
            assert r.status_code == status
        time.sleep(0.2)
        assert s.stderr() == ""
        assert s.stop() == 0
    assert s.stderr() == ""


class _Broken(MLXWorker):
    def check_health(self) -> None:
        raise RuntimeError("the device caught fire")


def test_an_internal_error_is_a_500_envelope_logged_with_its_request_id(home: str, caplog: pytest.LogCaptureFixture) -> None:
    """In process (no real fault to trigger on demand): a worker method raising an unexpected
    exception gives the 500 envelope, and both error lines carry the request id."""
    app = create_app(Config(home=home), worker=_Broken(Config(home=home)))
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="sidecar.rpc"):
        r = c.post("/rpc/check_health", headers={"x-request-id": "boom-1"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "boom-1"
        assert r.json()["error"] == {"type": "internal_error", "message": "RuntimeError: the device caught fire", "field": None}
        assert c.post("/rpc/vocab_size").status_code == 409  # still serving
    sc = app.state.sidecar
    assert sc.worker.state.value == "shut_down" and sc.clean_shutdown  # the lifespan's exit drained it
    errors = [x for x in caplog.records if x.levelno >= logging.ERROR]
    assert len(errors) == 2 and all(getattr(x, "request_id", None) == "boom-1" for x in errors)
    assert any(x.exc_info for x in errors)
    line = json.loads(JsonFormatter().format(next(x for x in errors if x.exc_info)))
    assert line["request_id"] == "boom-1" and "the device caught fire" in line["exc"]


def test_formatters_redact_secrets_and_bearer_credentials() -> None:
    add_secret("tok-\"quoted\"-123")
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "sent %s and %s", ("tok-\"quoted\"-123", "Bearer abc.DEF=="), None)
    rec.header = "authorization: Bearer zzz"
    for fmt in (JsonFormatter(), TextFormatter()):
        out = fmt.format(rec)
        assert "quoted" not in out and "abc.DEF" not in out and "zzz" not in out
        assert out.count("[redacted]") == 3
    assert "bearer token" in TextFormatter().format(logging.LogRecord("x", 20, "", 1, "missing bearer token", (), None))
