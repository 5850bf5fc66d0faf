"""The `/rpc/*` route: one ASGI route in front of the Starlette app, straight from the scope to the
RPC handler (`rpc_reply` in app.py) and back.

Every request whose path is under `/rpc/` (any verb) is answered here; everything else (probes,
/info, /metrics, lifespan) goes to Starlette. A decode step on a small model is ~1 ms of work, so
the per-call cost of the generic machinery shows: through Starlette (its middleware chain,
router, Request and Response) a call cost ~90 us more than this route (an RPC answered without
reaching the MLX thread: ~100 us here, ~190 us as a Starlette Route or a Mount of this same ASGI
handler, on the 2-core test box under load). The reply carries the headers Starlette would add:
content-length, content-type and the instance id (InstanceHeader adds it to everything else).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect

from sidecar.server.instance import INSTANCE_HEADER, Instance

log = logging.getLogger("sidecar.rpc")

_PREFIX = "/rpc/"

Reply = tuple[int, dict[str, str], bytes, str]  # status, headers, body, media type


class RPCRequest:
    """What the RPC handler reads of a request: headers (first value of each, lower-case names),
    the verb, the method name, and the body stream."""

    __slots__ = ("headers", "method", "path_params", "_receive")

    def __init__(self, headers: dict[str, str], method: str, rpc_method: str, receive: Callable[[], Awaitable[dict]]):
        self.headers, self.method, self.path_params, self._receive = headers, method, {"method": rpc_method}, receive

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
    """The method name when this is an HTTP request under /rpc/, else None."""
    if scope["type"] != "http":
        return None
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else None


def headers_of(scope: dict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        name = k.decode("latin-1").lower()
        if name not in headers:  # as Headers.get: the first one
            headers[name] = v.decode("latin-1")
    return headers


class SidecarApp(Starlette):
    """The Starlette app with the `/rpc/*` route in front."""

    def __init__(self, rpc_reply: Callable[[Any], Awaitable[Reply]], instance: Instance, **kwargs: Any):
        super().__init__(**kwargs)
        self._rpc_reply = rpc_reply
        self._instance_header = (INSTANCE_HEADER.encode(), instance.id.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:  # type: ignore[override]
        method = rpc_method(scope)
        if method is None:
            return await super().__call__(scope, receive, send)
        started = False
        try:
            request = RPCRequest(headers_of(scope), scope["method"], method, receive)
            status, headers, content, media_type = await self._rpc_reply(request)
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            raw += [(b"content-length", str(len(content)).encode()), (b"content-type", media_type.encode()),
                    self._instance_header]
            started = True
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": content})
        except Exception:
            # The handler answers every error itself; this is a bug. Still an envelope, and logged.
            log.exception("rpc: the route failed")
            if not started:
                body = b'{"error":{"type":"internal_error","message":"internal error","field":null}}'
                await send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                    self._instance_header]})
                await send({"type": "http.response.body", "body": body})
