"""docs/operations.md, Security and hardening end to end: binding rules, the bearer token, body and msgpack limits, content types,
per-call timeouts and the bounded queue, against real `mlx-sidecar serve` processes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.client.pipeline import Pipeline
from sidecar.models import resolve_model
from tests.server.serverproc import spawn, start_server

TOKEN = "s3cret-Token_0123456789abcdef"
BODY_LIMIT = 4096
MSGPACK = "application/msgpack"


def rpc(c: httpx.Client, method: str, body: bytes = b"", *, token: str | None = TOKEN, ctype: str | None = MSGPACK,
        **headers: str) -> httpx.Response:
    h = dict(headers)
    if ctype:
        h["content-type"] = ctype
    if token is not None:
        h["authorization"] = f"Bearer {token}"
    return c.post(f"/rpc/{method}", content=body, headers=h)


def error(r: httpx.Response) -> dict:
    body = msgpack.unpackb(r.content) if "msgpack" in r.headers["content-type"] else r.json()
    return body["error"]


# --- binding -----------------------------------------------------------------------------------


def test_unix_socket_is_owner_only_and_serves_a_remote_worker(home: str, tmp_path: Path) -> None:
    path = str(tmp_path / "sidecar.sock")
    with start_server("--uds", path) as s:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        w = RemoteWorker(f"unix://{path}")
        assert w.check_health() is None and w.last_request_id
        w.init_device()
        w.close()
        pipe = Pipeline(f"unix://{path}")  # two calls in flight on one connection
        pipe.submit("check_health")
        pipe.submit("check_health")
        assert [pipe.collect(), pipe.collect()] == [None, None] and not pipe.outstanding
        pipe.close()
        with s.client() as c:
            assert c.get("/healthz").status_code == 200
            assert c.get("/info").json()["state"] == "device_ready"
        assert s.stop() == 0
    assert not os.path.exists(path)  # removed on exit


def test_configurations_refused_at_start_up(home: str, tmp_path: Path) -> None:
    """Each exits 2 with a message saying what to do, before serving anything."""
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    not_a_socket = tmp_path / "file.sock"
    not_a_socket.write_text("keep me")
    cases = [
        (spawn("--host", "0.0.0.0", env={"MLX_SIDECAR_AUTH_TOKEN": None}),
         ["refusing to bind 0.0.0.0", "--auth-token-file", "--allow-insecure"]),
        (spawn("--auth-token-file", str(empty)), ["is empty"]),
        (spawn("--auth-token-file", str(tmp_path / "missing")), ["cannot read --auth-token-file"]),
        (spawn(env={"MLX_SIDECAR_AUTH_TOKEN": ""}), ["MLX_SIDECAR_AUTH_TOKEN is set but empty"]),
        (spawn("--uds", str(not_a_socket)), ["exists and is not a socket"]),
    ]
    for server, needles in cases:
        assert server.wait(60) == 2, server.stderr()
        err = server.stderr()
        for needle in needles:
            assert needle in err, err
        assert "Traceback" not in err
    assert not_a_socket.read_text() == "keep me"


def test_non_loopback_bind_starts_with_allow_insecure(home: str) -> None:
    with start_server("--host", "0.0.0.0", "--allow-insecure", env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s:
        with s.client() as c:
            assert rpc(c, "check_health", token=None).status_code == 200
        assert s.stop() == 0


# --- a hardened server: non-loopback with a token file, protected metrics, small body limit ---


@pytest.fixture(scope="module")
def hardened(home: str, tmp_path_factory: pytest.TempPathFactory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    flags = ["--host", "0.0.0.0", "--auth-token-file", str(token_file), "--protect-metrics",
             "--max-body-bytes", str(BODY_LIMIT), "--log-level", "debug", "--log-format", "json"]
    with start_server(*flags, env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s:
        with s.client() as c:
            s.c = c  # type: ignore[attr-defined]
            yield s


def test_the_bearer_token_is_required_on_every_rpc(hardened) -> None:
    c = hardened.c
    assert rpc(c, "check_health").status_code == 200
    assert c.post("/rpc/check_health", headers={"authorization": f"bearer {TOKEN}"}).status_code == 200
    rejected = [
        rpc(c, "check_health", token=None),
        rpc(c, "check_health", token="wrong"),
        rpc(c, "check_health", token=TOKEN[:-1]),
        rpc(c, "check_health", token=TOKEN + "x"),
        c.post("/rpc/check_health", headers={"authorization": "Bearer"}),
        c.post("/rpc/check_health", headers={"authorization": f"Basic {TOKEN}"}),
        c.post("/rpc/check_health", headers={"authorization": TOKEN}),
        c.post("/rpc/check_health", headers={"authorization": "Bearer t\xe9st".encode("latin-1")}),  # type: ignore[dict-item]
        rpc(c, "no_such_method", token=None),  # 401, not 404: method names are not probed without a token
        c.get("/rpc/execute_model"),
    ]
    bodies = set()
    for r in rejected:
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text and TOKEN[:8] not in r.text
        bodies.add(json.dumps(error(r)))
    # The same terse answer whatever was wrong.
    assert bodies == {json.dumps({"type": "unauthorized", "message": "missing or invalid bearer token", "field": None})}


def test_protect_metrics_covers_metrics_and_info_but_not_the_probes(hardened) -> None:
    c = hardened.c
    auth = {"authorization": f"Bearer {TOKEN}"}
    for path in ("/metrics", "/info"):
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"authorization": "Bearer nope"}).status_code == 401
        assert c.get(path, headers=auth).status_code == 200
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 503  # not ready (no model), but answered without a token
    assert "mlx_worker_info" in c.get("/metrics", headers=auth).text


def test_body_limit_is_413_with_or_without_content_length(hardened) -> None:
    c = hardened.c
    r = rpc(c, "check_health", b"\x80" + b"\x00" * BODY_LIMIT)
    assert r.status_code == 413 and error(r)["type"] == "payload_too_large"

    def chunks():
        for _ in range(8):
            yield b"\x00" * 1024

    r = c.post("/rpc/check_health", content=chunks(), headers={"content-type": MSGPACK, "authorization": f"Bearer {TOKEN}"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    # Just under the limit is read and decoded (and rejected for its content, not its size).
    r = rpc(c, "check_health", msgpack.packb({"pad": "x" * (BODY_LIMIT - 16)}))
    assert r.status_code == 400 and error(r)["field"] == "pad"
    assert rpc(c, "check_health").status_code == 200


def test_msgpack_and_json_limits_are_400(hardened) -> None:
    c = hardened.c

    def nested(depth: int) -> bytes:
        return b"\x81\xa6config" + b"\x91" * depth + b"\x00"  # {"config": [[[...0...]]]}

    cases = [
        nested(40),  # deeper than the 32 levels allowed
        nested(4000),  # deeper than msgpack's own stack (1024)
        b"\x81\xa6config\xdd\x7f\xff\xff\xff",  # an array header claiming 2**31 items, no items
        b"\x81\xa6config\xdb\x7f\xff\xff\xff",  # a string header claiming 2 GiB
        b"\x81\xa6config\xd4\x01\x00",  # an ext type
        b"\x81\xc4\x01k\x00",  # a binary map key
    ]
    for body in cases:
        r = rpc(c, "init_device", body)
        assert r.status_code == 400, (body[:20], r.text)
        assert error(r)["type"] == "invalid_request"
    assert "nesting deeper than 32" in error(rpc(c, "init_device", nested(40)))["message"]
    r = rpc(c, "init_device", b'{"config":' + b"[" * 2000 + b"]" * 2000 + b"}", ctype="application/json")
    assert r.status_code == 400
    assert rpc(c, "check_health").status_code == 200  # still serving


def test_content_types(hardened) -> None:
    c = hardened.c
    empty = msgpack.packb({})
    for ctype in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack",
                  "application/msgpack; charset=binary", "Application/MsgPack"):
        assert rpc(c, "check_health", empty, ctype=ctype).status_code == 200, ctype
    assert rpc(c, "check_health", b"{}", ctype="application/json").json() == {"result": None}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = rpc(c, "check_health", empty, ctype=ctype)
        assert r.status_code == 415 and error(r)["type"] == "unsupported_media_type", ctype
    r = rpc(c, "check_health", empty, ctype=None)  # a body without a type
    assert r.status_code == 415
    assert rpc(c, "check_health", b"", ctype=None).status_code == 200  # no body, no type: fine


def test_the_token_never_reaches_the_logs(hardened) -> None:
    """At debug level, after calls with the right token, near misses, and the token smuggled into
    other headers, not one log line holds it."""
    c = hardened.c
    rpc(c, "check_health")
    rpc(c, "check_health", token=TOKEN + "x")
    rpc(c, "check_health", **{"x-request-id": TOKEN})
    rpc(c, "no_such_method", **{"x-request-id": f"id-{TOKEN}"})
    c.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    time.sleep(0.2)
    err = hardened.stderr()
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    rpc_lines = [x for x in lines if x["msg"] == "rpc"]
    assert len(rpc_lines) >= 4 and all({"request_id", "method", "status", "duration_ms"} <= set(x) for x in rpc_lines)
    assert TOKEN not in err and TOKEN[:12] not in err and TOKEN[-12:] not in err


# --- per-call timeout and the bounded queue ----------------------------------------------------


def test_call_timeout_and_bounded_queue(home: str, tmp_path: Path) -> None:
    """max-queue 1, call-timeout 1 s, and a call running that cannot end before the test lets it: a
    load_model waiting for the built-in's generation lock (held here, as another process generating
    builtin:tiny on first use would hold it). A queued call is dropped after 1 s with 503 +
    Retry-After (and never runs), one more call finds the queue full (503 + Retry-After at once),
    the running call finishes with 200 although it took longer than the timeout. Only the dropped
    calls are logged at the default level, each with its request id."""
    fresh = tmp_path / "home"
    models = fresh / "models"
    models.mkdir(parents=True)
    built = resolve_model("builtin:tiny", home)
    flags = ["--max-queue", "1", "--call-timeout", "1", "--log-format", "json"]
    env = {"MLX_SIDECAR_AUTH_TOKEN": None, "MLX_SIDECAR_HOME": str(fresh)}
    with open(models / ".lock", "a") as lock, start_server(*flags, env=env) as s:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remote = RemoteWorker(s.url)
        remote.init_device()
        results: dict[str, object] = {}

        def long_call() -> None:
            w = RemoteWorker(s.url)
            t0 = time.monotonic()
            results["load"] = w.load_model()
            results["load_s"] = time.monotonic() - t0
            w.close()

        def queued() -> None:
            # `shutdown` would free the model: if it ever ran, the worker would have none after.
            t0 = time.monotonic()
            results["queued"] = httpx.post(f"{s.url}/rpc/shutdown", timeout=30, headers={"x-request-id": "queued-1"})
            results["queued_s"] = time.monotonic() - t0

        a = threading.Thread(target=long_call)
        a.start()
        with httpx.Client(base_url=s.url, timeout=30) as c:
            deadline = time.monotonic() + 30
            while not c.get("/info").json()["busy"]:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            b = threading.Thread(target=queued)
            b.start()
            while c.get("/info").json()["queue_depth"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            t0 = time.monotonic()
            full = c.post("/rpc/shutdown", headers={"x-request-id": "full-1"})
            assert time.monotonic() - t0 < 0.5
            b.join()
            assert a.is_alive() and c.get("/info").json()["busy"]  # the load still waits
            # The other "process" finishes the model (atomically, as the store does) and lets go.
            shutil.copytree(built, models / f".copy-{built.name}")
            os.rename(models / f".copy-{built.name}", models / built.name)
            fcntl.flock(lock, fcntl.LOCK_UN)
            a.join()
            assert full.status_code == 503 and "queue is full" in full.json()["error"]["message"]
            assert int(full.headers["retry-after"]) >= 1
            q = results["queued"]
            assert isinstance(q, httpx.Response) and q.status_code == 503, q
            assert "waited 1s" in q.json()["error"]["message"] and int(q.headers["retry-after"]) >= 1
            assert 0.9 < results["queued_s"] < results["load_s"]  # type: ignore[operator]
            assert results["load"] is None and results["load_s"] > 1  # type: ignore[operator]
            # Neither shutdown ran: the worker keeps its model and goes on from there.
            assert c.get("/info").json()["state"] == "model_loaded"
            assert remote.get_model()["path"].endswith(built.name)
            with pytest.raises(RemoteError) as e:
                remote.load_model()
            assert e.value.status == 409
            remote.close()
        time.sleep(0.2)
        lines = [json.loads(line) for line in s.stderr().splitlines() if line.startswith("{")]
        logged = {x["request_id"]: x for x in lines if x.get("msg") == "rpc"}
        assert set(logged) == {"queued-1", "full-1"}, lines  # quiet by default: no line for the 200s
        for x in logged.values():
            assert x["status"] == 503 and x["level"] == "warning" and x["method"] == "shutdown"
