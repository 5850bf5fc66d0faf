"""HTTP details of the RPC route: request ids, content negotiation, reading the body, encoding the reply."""

from __future__ import annotations

import itertools
import os
import re
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from sidecar.wire.codec import JSON_TYPE, MSGPACK_TYPES, encode_body
from sidecar.errors import ClientClosed, PayloadTooLarge, Unavailable

# An incoming X-Request-Id is reused when it is a plain token (no spaces, quotes or control
# characters that could forge log lines); anything else is replaced by a fresh id.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,127}")


# Generated ids: a random per-process half and a counter (16 hex digits): unique within a server's
# life and across restarts in practice, without a uuid4 (a getrandom syscall) per call.
_PREFIX = os.urandom(4).hex()
_SERIAL = itertools.count(int.from_bytes(os.urandom(4), "big"))


def request_id(given: str | None) -> str:
    if given and _REQUEST_ID.fullmatch(given):
        return given
    return f"{_PREFIX}{next(_SERIAL) & 0xFFFFFFFF:08x}"


def media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def wants_msgpack(accept: str, in_type: str) -> bool:
    accept = accept.lower()
    if any(t in accept for t in MSGPACK_TYPES):
        return True
    if JSON_TYPE in accept:
        return False
    return in_type in MSGPACK_TYPES


class BodyBudget:
    """The bytes of request bodies the server holds at once, read or being read, until their calls
    are answered (each call's decoded body and result live that long too): so many connections,
    or a queue of calls, each with a body just under the limit, cannot add up without bound."""

    def __init__(self, total: int):
        self.total, self.held = total, 0

    def take(self, n: int) -> None:
        if self.held + n > self.total:
            raise Unavailable(f"the server holds {self.held} bytes of request bodies, its budget is {self.total} "
                              "(4 x --max-body-bytes); retry", retry_after=1)
        self.held += n

    def release(self, n: int) -> None:
        self.held = max(0, self.held - n)

    def holding(self, handler: Callable[[Any, list[int]], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        """`handler(request, held)` as `call(request)`, releasing what it took (`held[0]`) at the end."""
        async def call(request: Any) -> Any:
            held = [0]
            try:
                return await handler(request, held)
            finally:
                self.release(held[0])

        return call


async def read_body(request: Request, limit: int, budget: BodyBudget | None = None, held: list[int] | None = None) -> bytes:
    """The whole body; with `budget`, each chunk is taken from it and its size added to `held[0]`
    (the caller releases that once the call is answered)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"body of {length} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
            if budget is not None and held is not None:
                budget.take(len(chunk))
                held[0] += len(chunk)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientClosed(f"the client closed the connection after {size} body bytes") from None
    return b"".join(chunks)


def encode_reply(payload: Any, as_msgpack: bool) -> tuple[bytes, Exception | None]:
    """The reply body; when the payload cannot be encoded, a 500 envelope (ASCII-only message) and
    the exception."""
    try:
        return encode_body(payload, as_msgpack), None
    except Exception as e:  # noqa: BLE001
        message = ascii(f"the reply could not be encoded: {type(e).__name__}: {e}")[1:-1]
        return encode_body({"error": {"type": "internal_error", "message": message, "field": None}}, as_msgpack), e
