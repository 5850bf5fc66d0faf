"""The lean path for `/rpc/*`: straight from the ASGI scope to the RPC handler and back.

A decode step on a small model is ~1 ms of work, so the per-call cost of the generic machinery
shows: Starlette's middleware chain (three wrappers around `send`), router, Request (a Headers
object per call), Response (its header list) and the exception middlewares. `LeanApp` is the
Starlette app with one shortcut in front: an HTTP request for `/rpc/<method>` with a verb the
route takes goes to the same handler (`rpc_reply` in app.py) with a `LeanRequest`, and its reply
is sent as two ASGI messages with the headers Starlette would have sent (the handler's, then
content-length, content-type, and the instance id InstanceHeader adds). Everything else (probes,
/metrics, lifespan, a root_path mount, odd paths) goes through Starlette as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect

from sidecar.server.instance import INSTANCE_HEADER, Instance
from sidecar.server.replygate import ReplyGate

log = logging.getLogger("sidecar.rpc")

# The verbs the /rpc/ route takes (app.py lists them); any other is Starlette's 405.
RPC_VERBS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_PREFIX = "/rpc/"

Reply = tuple[int, dict[str, str], bytes, str]  # status, headers, body, media type


class LeanRequest:
    """What the RPC handler reads of a request: headers (first value of each, lower-case names),
    the verb, the method name, and the body stream; and the gate the MLX thread waits on before
    its after-reply work (opened once the reply is written, server/replygate.py)."""

    __slots__ = ("headers", "method", "path_params", "_receive", "reply_gate")

    def __init__(self, headers: dict[str, str], method: str, rpc_method: str, receive: Callable[[], Awaitable[dict]]):
        self.headers, self.method, self.path_params, self._receive = headers, method, {"method": rpc_method}, receive
        self.reply_gate = ReplyGate()

    async def stream(self) -> AsyncIterator[bytes]:
        """The body's chunks, as Starlette's Request.stream (ClientDisconnect when the client goes)."""
        while True:
            message = await self._receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if body:
                    yield body
                if not message.get("more_body", False):
                    return
            elif message["type"] == "http.disconnect":
                raise ClientDisconnect()


def rpc_method(scope: dict) -> str | None:
    """The method name when the lean path takes this request, else None."""
    if scope["type"] != "http":
        return None
    path = scope["path"]
    if (not path.startswith(_PREFIX) or scope.get("root_path")
            or scope["method"] not in RPC_VERBS or "\n" in path):  # (the route's pattern stops at a newline)
        return None
    return path[len(_PREFIX):]


def headers_of(scope: dict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        name = k.decode("latin-1").lower()
        if name not in headers:  # as Headers.get: the first one
            headers[name] = v.decode("latin-1")
    return headers


class LeanApp(Starlette):
    def __init__(self, rpc_reply: Callable[[Any], Awaitable[Reply]], instance: Instance, **kwargs: Any):
        super().__init__(**kwargs)
        self._rpc_reply = rpc_reply
        self._instance_header = (INSTANCE_HEADER.encode(), instance.id.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:  # type: ignore[override]
        method = rpc_method(scope)
        if method is None:
            return await super().__call__(scope, receive, send)
        started = False
        request: LeanRequest | None = None
        try:
            request = LeanRequest(headers_of(scope), scope["method"], method, receive)
            status, headers, content, media_type = await self._rpc_reply(request)
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            raw += [(b"content-length", str(len(content)).encode()), (b"content-type", media_type.encode()),
                    self._instance_header]
            started = True
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": content})
        except Exception:
            # The handler answers every error itself; this is a bug. Still an envelope, as
            # Starlette's ServerErrorMiddleware would send a 500 (its text body), and logged.
            log.exception("rpc: the lean path failed")
            if not started:
                body = b'{"error":{"type":"internal_error","message":"internal error","field":null}}'
                await send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                    self._instance_header]})
                await send({"type": "http.response.body", "body": body})
        finally:
            if request is not None:
                # After the transport's gathered write (server/coalesce.py flushes in a callback
                # scheduled by the first write, so this one runs after it).
                asyncio.get_running_loop().call_soon(request.reply_gate.open)


def http_protocol(read_timeout: float = 60.0, max_connections: int = 512) -> Any:
    """For uvicorn: its httptools protocol with one write per reply (server/coalesce.py) and the
    per-connection bounds (server/connguard.py), when httptools is installed; else uvicorn's own."""
    try:
        from sidecar.server.connguard import guarded_protocol
    except ImportError:
        return "auto"
    return guarded_protocol(read_timeout, max_connections)
