"""One write per reply: uvicorn's httptools protocol with its transport's writes gathered.

uvicorn writes a reply's head and its body with two `transport.write` calls, and uvloop sends
each at once: two syscalls, two TCP segments, and a client woken for the head that must wait for
the body. On a loopback decode step that is a measurable share of the round trip. Here every
write made while handling the loop's current callbacks is gathered and sent as one at the end of
them (`loop.call_soon`), or as soon as the reply is complete; a close or an abort flushes first,
so nothing is lost or reordered.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class GatheringTransport:
    """Delegates to `transport`; `write` gathers until the loop runs the flush it scheduled."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatheringHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(GatheringTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        # The reply is whole: send it now, not after the rest of the loop's current callbacks (the
        # request task's end, the keep-alive timer) have run.
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()
