"""Per-connection bounds: what a client costs the server before its request reaches a handler.

uvicorn closes a kept-alive connection only after a response (and any byte cancels that timer),
reads a request's head and body for as long as the client takes, and holds as many connections as
the process has file descriptors. So a client that connects and sends nothing, or a head or body
one byte every few seconds (slowloris), holds a socket forever; a few thousand of them exhaust the
descriptors and nobody else is served.

Why a subclass of uvicorn's (private) httptools protocol: its public config has no bound for
these. `timeout_keep_alive` starts only after a response; there is no read timeout for a request's
head or body; `limit_concurrency` answers 503 past N connections + tasks but never closes an idle
connection to make room (so idle keep-alives would lock out a scheduler); `h11_max_incomplete_event_size`
bounds a head only under the h11 parser, not httptools. Here:

- a connection with no request in it (fresh, or after a response) is closed after `idle_timeout`
  seconds, whatever bytes that are no request it sends (uvicorn's keep-alive timeout);
- a request must arrive whole, head and body, within `read_timeout` seconds of its first byte, else
  it is answered 408 and the connection closed (nothing ran: the handler reads the whole body
  before it queues a call). The handler itself has no deadline here: a step runs to its end;
- past `max_connections`, a new connection first closes the longest-idle one, then the longest
  reading one; when every connection has a call running, the new one is answered 503 + Retry-After;
- a request's head is at most MAX_HEAD_BYTES (431 past it).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _reply(status: str, message: str, kind: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"type": kind, "message": message, "field": None}}).encode()
    extra = f"retry-after: {retry_after}\r\n" if retry_after else ""
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
            "connection: close\r\n\r\n").encode() + body


# A request's head (request line + headers) at most: uvicorn's httptools parser has no bound, and
# grows the URL by concatenation (a 200 MB URL held 400 MB, and its copies the event loop).
MAX_HEAD_BYTES = 64 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Set by `http_protocol` (a subclass per server): the bounds."""

    read_timeout = 60.0
    max_connections = 512
    max_head_bytes = MAX_HEAD_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._in_flight = 0  # requests of this connection whose head is parsed and reply not complete
        self._reading = False  # a request's bytes are arriving (from its first byte to its body's last)
        self._head_done = False  # ... and its head is parsed (it is one of the _in_flight)
        self._since = time.monotonic()  # when the current idle or read period began
        self._head_bytes = 0  # bytes received since the last head was complete
        self._write_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections and not self._make_room():
            transport.write(_reply("503 Service Unavailable", f"the server holds {self.max_connections} connections, "
                                   "each with a call running (--max-connections)", "unavailable", retry_after=1))
            transport.close()
            return
        self._arm(self.timeout_keep_alive, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if getattr(self, "_write_timer", None) is not None:
            self._write_timer.cancel()  # type: ignore[union-attr]
        super().connection_lost(exc)

    # A reply the client does not read: past the transport's high-water mark its handler waits (it
    # would hold the connection, unevictable, forever); after read_timeout the connection is dropped.
    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_timer = self.loop.call_later(self.read_timeout, self._shut, True)

    def resume_writing(self) -> None:
        super().resume_writing()
        if getattr(self, "_write_timer", None) is not None:
            self._write_timer.cancel()  # type: ignore[union-attr]
            self._write_timer = None

    def _shut(self, drop: bool = False) -> None:
        """Close; with unsent reply bytes (a client that stopped reading), drop them and the socket
        now: a plain close would wait for them, holding the descriptor for as long as the client likes."""
        if not self.transport.is_closing() or drop:
            if drop or self.transport.get_write_buffer_size():
                self.transport.abort()
            else:
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        counting = not (self._reading and self._head_done)  # (a body's bytes are not counted)
        if counting:
            self._head_bytes += len(data)
        super().data_received(data)
        if counting and self._head_bytes > self.max_head_bytes and not (self._reading and self._head_done) \
                and not self.transport.is_closing():
            self._close_reading("431 Request Header Fields Too Large", f"a request head is at most "
                                f"{self.max_head_bytes} bytes (request line and headers)", "header_too_large")

    # -- the parser's callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading, self._head_done, self._since = True, False, time.monotonic()
        self._arm(self.read_timeout, self._read_expired)

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        self._head_bytes = 0
        if self.cycle is not before:
            self._in_flight += 1
            self._head_done = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._cancel()

    def on_response_complete(self) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._reading:  # a pipelined request waited for this one: its read time starts now
            self._since = time.monotonic()
            self._arm(self.read_timeout, self._read_expired)
        elif not self._in_flight:
            self._since = time.monotonic()
            self._arm(self.timeout_keep_alive, self._idle_expired)

    # -- timers

    def _arm(self, seconds: float, fn: Any) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, fn)

    def _cancel(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    @property
    def _idle(self) -> bool:
        return not self._reading and not self._in_flight

    def _others_running(self) -> bool:
        """An earlier request of this connection is still in its handler."""
        return self._in_flight - (1 if self._reading and self._head_done else 0) > 0

    def _idle_expired(self) -> None:
        self._timer = None
        if self._idle and not self.transport.is_closing():
            self._shut()

    def _read_expired(self) -> None:
        self._timer = None
        if not self._reading or self._others_running() or self.transport.is_closing():
            return  # (on_response_complete re-arms it)
        self._close_reading("408 Request Timeout", f"the request did not arrive whole within {self.read_timeout:g}s "
                            "(--read-timeout)", "request_timeout")

    def _close_reading(self, status: str, message: str, kind: str, retry_after: int | None = None) -> None:
        """Answer the request being read (unless its handler already answered) and close."""
        if not (self._head_done and self.cycle is not None and self.cycle.response_started):
            self.transport.write(_reply(status, message, kind, retry_after))
        self.transport.close()

    def _make_room(self) -> bool:
        """Close one other connection that has no call running: the longest idle, else the longest
        reading (its request never reached a handler). False when there is none."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedHttpToolsProtocol)
                and hasattr(c, "_timer") and not c.transport.is_closing()]
        for kind in ("idle", "reading"):
            pick = [c for c in idle if (c._idle if kind == "idle" else c._reading and not c._others_running())]
            if pick:
                victim = min(pick, key=lambda c: c._since)
                if kind == "idle":
                    victim._shut()
                else:
                    victim._close_reading("503 Service Unavailable", "the server is at --max-connections; this "
                                          "connection was the longest reading one", "unavailable", retry_after=1)
                self.connections.discard(victim)
                return True
        return False


def http_protocol(read_timeout: float = 60.0, max_connections: int = 512) -> type[GuardedHttpToolsProtocol]:
    """For uvicorn's `http`: its httptools protocol with the bounds (a subclass per server)."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"read_timeout": read_timeout, "max_connections": max_connections})


def fd_room(max_connections: int, spare: int = 64) -> int:
    """Raise the soft open-files limit toward the hard one, as far as `max_connections` needs, and
    return how many connections fit under it (each is a descriptor; `spare` for the model's files,
    the log and the listener)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = max_connections + spare
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    except (ImportError, OSError, ValueError):
        return max_connections
    return max_connections if soft == resource.RLIM_INFINITY else max(1, min(max_connections, soft - spare))
