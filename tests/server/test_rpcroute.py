"""The /rpc/ route (server/rpcroute.py): good, bad and refused calls are answered with their
status, the error envelope and the headers every reply carries; and which requests it takes."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from starlette.testclient import TestClient

from sidecar.config import Config
from sidecar.server.app import create_app
from sidecar.server.rpcroute import rpc_method

MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
# (verb, path, headers, body): good, bad and refused calls
CALLS: list[tuple[str, str, dict[str, str], bytes | None]] = [
    ("POST", "/rpc/check_health", {}, None),
    ("POST", "/rpc/init_device", {"content-type": "application/json"}, b'{"bogus": 1}'),
    ("POST", "/rpc/init_device", {"content-type": "application/json"}, b'{"config": '),
    ("POST", "/rpc/load_model", {}, None),
    ("POST", "/rpc/vocab_size", MSGPACK, msgpack.packb({})),
    ("POST", "/rpc/no_such_method", {}, None),
    ("POST", "/rpc/a/b", {}, None),
    ("GET", "/rpc/check_health", {}, None),
    ("DELETE", "/rpc/check_health", {}, None),
    ("TRACE", "/rpc/check_health", {}, None),
    ("POST", "/rpc/check_health", {"content-type": "text/plain"}, b"hi"),
    ("POST", "/rpc/check_health", {"x-sidecar-expect-instance": "someone-else"}, None),
    ("POST", "/rpc/check_health", {"authorization": "Bearer wrong"}, None),
    ("POST", "/rpc/check_health", {"authorization": "Bearer t0ken", "x-request-id": "has spaces"}, None),
]


def _answers(client: TestClient) -> list[tuple[int, dict[str, str], Any]]:
    out = []
    for i, (verb, path, headers, body) in enumerate(CALLS):
        r = client.request(verb, path, headers={"x-request-id": f"call-{i}", **headers}, content=body)
        h = {k: v for k, v in r.headers.items() if k not in ("server-timing", "x-request-id")}
        h["server-timing"] = "exec;dur=" if r.headers.get("server-timing", "").startswith("exec;dur=") else ""
        rid = r.headers.get("x-request-id", "")
        h["x-request-id"] = rid if rid.startswith("call-") else f"generated {len(rid)}"
        out.append((r.status_code, h, r.content))
    return out


@pytest.mark.parametrize("token", [None, "t0ken"])
def test_every_rpc_is_answered_with_its_status_envelope_and_headers(home: str, token: str | None) -> None:
    app = create_app(Config(home=home), token=token)
    with TestClient(app) as client:  # (runs the lifespan: the MLX thread)
        got = _answers(client)
        idle = client.get("/info").json()["mlx_thread_idle_seconds"]  # (its MLX thread mostly waited)
    assert isinstance(idle, float) and idle > 0
    statuses = [s for s, _, _ in got]
    assert statuses == ([200, 400, 400, 409, 409, 404, 404, 405, 405, 405, 415, 409, 200, 200] if token is None
                        else [401] * 13 + [200])
    for (status, headers, body), call in zip(got, CALLS):
        assert headers["x-sidecar-instance"] == app.state.sidecar.instance.id, call
        assert headers["content-length"] == str(len(body)), call
        assert headers["x-request-id"].startswith("call-") or call is CALLS[-1]
        if status != 200:
            kind = msgpack.unpackb(body) if headers["content-type"] == "application/msgpack" else json.loads(body)
            assert set(kind["error"]) == {"type", "message", "field"}, call
    assert token or b"bogus" in got[1][2]  # (400 naming the field)
    assert got[0][1]["server-timing"] == ("" if token else "exec;dur=")
    assert got[7][1].get("allow") == (None if token else "POST")
    assert got[13][1]["x-request-id"] == "generated 16"  # (an unsafe incoming id is replaced)


def test_only_rpc_paths_take_the_rpc_route() -> None:
    scope = {"type": "http", "path": "/rpc/x", "method": "POST", "root_path": ""}
    assert rpc_method(scope) == "x"
    assert rpc_method({**scope, "path": "/rpc/"}) == ""
    assert rpc_method({**scope, "method": "TRACE"}) == "x"  # (answered 405 by the handler, counted)
    assert rpc_method({**scope, "root_path": "/mount", "path": "/mount/rpc/x"}) == "x"
    for other in ({"path": "/info"}, {"path": "/rpcx"}, {"type": "websocket"}):
        assert rpc_method({**scope, **other}) is None, other
    assert rpc_method({"type": "lifespan"}) is None
