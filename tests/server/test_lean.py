"""The lean /rpc/ path (server/lean.py) answers exactly as the Starlette route it bypasses, and
uvicorn with the gathering transport (server/coalesce.py) sends each reply as one write."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgpack
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from sidecar.config import Config
from sidecar.server.app import create_app
from sidecar.server.coalesce import GatheringTransport
from sidecar.server.lean import rpc_method
from tests.server.serverproc import start_server

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
def test_the_lean_path_answers_as_the_starlette_route(home: str, token: str | None) -> None:
    app = create_app(Config(home=home), token=token)

    async def through_starlette(scope: dict, receive: Any, send: Any) -> None:
        await Starlette.__call__(app, scope, receive, send)  # (the router, Request, Response, middleware)

    with TestClient(app) as lean:  # (runs the lifespan: the MLX thread both clients call into)
        starlette = TestClient(through_starlette)
        got, want = _answers(lean), _answers(starlette)
        idle = lean.get("/info").json()["mlx_thread_idle_seconds"]  # (its MLX thread mostly waited)
    assert isinstance(idle, float) and idle > 0
    statuses = [s for s, _, _ in got]
    assert statuses == ([200, 400, 400, 409, 409, 404, 404, 405, 405, 415, 409, 200, 200] if token is None
                        else [401] * 12 + [200])
    for call, g, w in zip(CALLS, got, want):
        assert g == w, call
    assert "x-sidecar-instance" in got[0][1] and got[7][1].get("allow") == (None if token else "POST")
    assert got[12][1]["x-request-id"] == "generated 16"  # (an unsafe incoming id is replaced)


def test_only_rpc_paths_take_the_lean_path() -> None:
    scope = {"type": "http", "path": "/rpc/x", "method": "POST", "root_path": ""}
    assert rpc_method(scope) == "x"
    assert rpc_method({**scope, "path": "/rpc/"}) == ""
    for other in ({"path": "/info"}, {"path": "/rpcx"}, {"method": "TRACE"}, {"root_path": "/mount"},
                  {"path": "/rpc/a\nb"}, {"type": "websocket"}):
        assert rpc_method({**scope, **other}) is None, other
    assert rpc_method({"type": "lifespan"}) is None


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_the_gathering_transport_sends_one_write_per_loop_turn_and_flushes_before_closing() -> None:
    async def main() -> _Recorder:
        rec = _Recorder()
        t = GatheringTransport(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.write(bytearray(b"body"))
        assert rec.writes == []  # nothing yet: gathered until the loop turns
        await asyncio.sleep(0)
        assert rec.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.writelines([b"a", b"b"])
        t.close()  # flushes first
        assert rec.writes[1:] == [b"ab"] and rec.closed
        await asyncio.sleep(0)  # the flush scheduled for "a" finds nothing left
        assert len(rec.writes) == 2
        t2 = GatheringTransport(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
        t2.write(b"dropped")
        t2.abort()
        await asyncio.sleep(0)
        assert rec.aborted and len(rec.writes) == 2 and t2.get_extra_info("peername") == "info:peername"
        return rec

    asyncio.run(main())


def test_a_complete_reply_is_written_at_once_not_a_loop_turn_later() -> None:
    """The protocol flushes when the reply is complete: the client has it before the rest of the
    loop's callbacks (the request task's end, the keep-alive timer) run."""
    from uvicorn.config import Config as UvicornConfig
    from uvicorn.server import ServerState

    from sidecar.server.coalesce import GatheringHttpToolsProtocol

    seen: dict[str, list[bytes]] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        rec = proto.transport._transport  # type: ignore[attr-defined]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        seen["after head"] = list(rec.writes)
        await send({"type": "http.response.body", "body": b"ok"})
        seen["after body"] = list(rec.writes)

    class Transport(_Recorder):
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...

        def get_extra_info(self, name: str) -> Any:
            return None

    async def main() -> None:
        nonlocal proto
        config = UvicornConfig(app=app, http=GatheringHttpToolsProtocol, log_config=None, lifespan="off")
        config.load()
        proto = GatheringHttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
        rec = Transport()
        proto.connection_made(rec)  # type: ignore[arg-type]
        proto.data_received(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
        for _ in range(5):
            await asyncio.sleep(0)
        proto.connection_lost(None)

    proto: Any = None
    asyncio.run(main())
    assert seen["after head"] == []  # the head alone is gathered (control: nothing is sent early)
    assert len(seen["after body"]) == 1 and seen["after body"][0].endswith(b"\r\n\r\nok")
    assert seen["after body"][0].startswith(b"HTTP/1.1 200 OK\r\n")


def _read_reply(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes, int, bytes]:
    """One reply (head, body) from buf + the socket; how many recvs it took, and what follows it."""
    recvs = 0
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
        recvs += 1
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int(next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"))
    while len(rest) < n:
        rest += sock.recv(65536)
        recvs += 1
    return head, rest[:n], recvs, rest[n:]


def test_a_real_server_sends_each_reply_in_one_write_also_when_pipelined(home: str) -> None:
    with start_server(env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s, socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1]))) as sock:
        req = b"POST /rpc/check_health HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nx-request-id: r%d\r\n\r\n"
        sock.sendall(req % 1)
        head, body, recvs, _ = _read_reply(sock, b"")
        assert head.startswith(b"HTTP/1.1 200") and b"x-request-id: r1" in head and body == b'{"result":null}'
        assert recvs == 1  # head and body came as one write (uvicorn alone writes them separately)
        sock.sendall(req % 2 + req % 3)  # two pipelined requests on the kept-alive connection
        rest = b""
        for i in (2, 3):
            head, body, _, rest = _read_reply(sock, rest)
            assert head.startswith(b"HTTP/1.1 200") and f"x-request-id: r{i}".encode() in head
