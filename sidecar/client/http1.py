"""The one HTTP/1.1 client connection (TCP or Unix socket): keep-alive, and pipelining.

`request` may be called again before the previous reply is read; `getresponse` returns the replies
in the order the requests were sent (HTTP/1.1 keeps that order on the wire, and the server answers
pipelined requests one after the other). A request's head and body go out in one `sendall`
(TCP_NODELAY): http.client sends them as two writes, which the server reads and parses separately.
Replies are parsed by httptools (llhttp, the parser uvicorn serves with; as fast as the plain
string splits it replaced, where h11 cost ~30x that per reply), fed with as few `recv`s as the
kernel allows. Bodies are framed by Content-Length or chunked, or run to the close of the connection.

The interface is the subset of http.client.HTTPConnection that the callers use, and the failures
are http.client's own exceptions, so a caller's handling of lost replies is the standard library's:
RemoteDisconnected when the server closed the connection before any byte of the reply,
IncompleteRead for a reply cut short, BadStatusLine for bytes that are no HTTP reply, LineTooLong
for a reply head over MAX_HEAD, OSError (socket.timeout, ConnectionResetError, ...) from the socket.
After a failure the connection is closed and the replies still outstanding on it are lost. No MLX.
"""

from __future__ import annotations

import http.client
import socket
from collections import deque

import httptools

MAX_HEAD = 64 * 1024  # a reply head larger than this is refused (http.client's own limits are similar)


class Response:
    __slots__ = ("status", "reason", "_headers", "_data", "keep_alive")

    def __init__(self, status: int, reason: str, headers: dict[str, str], data: bytes, keep_alive: bool = True):
        self.status, self.reason, self._headers, self._data, self.keep_alive = status, reason, headers, data, keep_alive

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self._headers.get(name.lower(), default)

    def getheaders(self) -> list[tuple[str, str]]:
        return list(self._headers.items())

    def read(self) -> bytes:
        return self._data


class Connection:
    """One keep-alive connection to `host:port`, or to the Unix socket `uds` when given."""

    def __init__(self, host: str = "127.0.0.1", port: int = 80, timeout: float | None = None, *, uds: str | None = None):
        self.host, self.port, self.timeout, self.uds = host, port, timeout, uds
        self.sock: socket.socket | None = None
        self.outstanding = 0  # requests sent on this connection whose reply is not read yet
        self._ready: deque[Response] = deque()  # replies parsed, not returned yet
        name = f"[{host}]" if ":" in host else host  # (an IPv6 literal)
        self._host_header = "localhost" if uds else (f"{name}:{port}" if port != 80 else name)
        self._reset_reply()

    def connect(self) -> None:
        if self.uds:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: object = self.uds
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            address = (self.host, self.port)
        try:
            sock.settimeout(self.timeout)
            if not self.uds:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        self.sock, self.outstanding = sock, 0
        self._parser = httptools.HttpResponseParser(self)
        self._ready.clear()
        self._reset_reply()

    def close(self) -> None:
        sock, self.sock, self.outstanding = self.sock, None, 0
        self._ready.clear()
        if sock is not None:
            sock.close()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> None:
        if method == "HEAD":  # (the parser would read the reply's Content-Length as a body to come)
            raise ValueError("HEAD is not supported")
        if self.sock is None:
            self.connect()
        parts = [f"{method} {path} HTTP/1.1\r\nhost: {self._host_header}\r\n"]
        for k, v in (headers or {}).items():
            parts.append(f"{k}: {v}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            parts.append(f"content-length: {len(body or b'')}\r\n")
        parts.append("\r\n")
        head = "".join(parts).encode("latin-1")
        assert self.sock is not None
        try:
            self.sock.sendall(head + body if body else head)
        except OSError:
            self.close()
            raise
        self.outstanding += 1

    def getresponse(self) -> Response:
        """The reply to the oldest request whose reply was not read yet."""
        if not self.outstanding:
            raise http.client.ResponseNotReady("no request is outstanding")
        try:
            while not self._ready:
                self._fill()
        except BaseException:
            self.close()  # the connection's framing is lost
            raise
        resp = self._ready.popleft()
        self.outstanding -= 1
        if not resp.keep_alive and not self.outstanding:
            self.close()  # (with replies outstanding, the next read meets the close and says so)
        return resp

    # -- reading ----------------------------------------------------------------------------

    def _fill(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            self._at_eof()
            return
        if not self._head_done:
            self._head_bytes += len(chunk)
        try:
            self._parser.feed_data(chunk)
        except httptools.HttpParserError as e:
            raise http.client.BadStatusLine(f"not an HTTP reply ({e})") from None
        if not self._head_done and self._in_reply and self._head_bytes > MAX_HEAD:
            raise http.client.LineTooLong("reply head")

    def _at_eof(self) -> None:
        if not self._in_reply:
            raise http.client.RemoteDisconnected("Remote end closed connection without response")
        if self._head_done and self._to_close:  # a body delimited by the close: it is whole now
            self._ready.append(Response(self._parser.get_status_code(), self._reason, self._headers,
                                        b"".join(self._body), False))
            self._reset_reply()
            return
        raise http.client.IncompleteRead(b"".join(self._body))

    def _reset_reply(self) -> None:
        self._in_reply = self._head_done = self._to_close = False
        self._head_bytes = 0
        self._reason = ""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    # httptools' callbacks, called from feed_data (for every reply a chunk holds)

    def on_message_begin(self) -> None:
        self._in_reply = True

    def on_status(self, reason: bytes) -> None:
        self._reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        k, v = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[k] = f"{self._headers[k]}, {v}" if k in self._headers else v

    def on_headers_complete(self) -> None:
        self._head_done, self._head_bytes = True, 0
        h = self._headers
        self._to_close = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200:  # (a 1xx we did not ask for: the real reply follows)
            self._ready.append(Response(status, self._reason, self._headers, b"".join(self._body),
                                        self._parser.should_keep_alive()))
        self._reset_reply()
