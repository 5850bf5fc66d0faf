"""A minimal HTTP/1.1 client connection for RemoteWorker: one send and (usually) one receive per call.

http.client sends a request's headers and body as two writes (two TCP segments the server reads
and parses separately) and parses the reply's headers line by line through the email package:
on a decode step of a small model that was a visible share of the client's CPU and of the round
trip. This sends head and body in one `sendall` (TCP_NODELAY), reads the reply head and body
with as few `recv`s as the kernel allows, and parses the head with plain string splits.

The interface is the subset of http.client.HTTPConnection that the callers use (`request`,
`getresponse`, `close`; a response with `status`, `getheader`, `getheaders`, `read`), and the
failures are http.client's own exceptions, so a caller's handling of lost replies is unchanged:
RemoteDisconnected when the server closed the connection before any reply byte, IncompleteRead
for a reply cut short, CannotSendRequest for a second request before the reply is read, OSError
(BrokenPipeError, ConnectionResetError, socket.timeout, ...) from the socket itself. Bodies are
framed by Content-Length or chunked, or run to the close of the connection. No MLX.
"""

from __future__ import annotations

import http.client
import socket

MAX_HEAD = 64 * 1024  # a reply head larger than this is refused (http.client's own limits are similar)
_NO_BODY = frozenset({204, 304})


class Response:
    __slots__ = ("status", "reason", "_headers", "_data")

    def __init__(self, status: int, reason: str, headers: dict[str, str], data: bytes):
        self.status, self.reason, self._headers, self._data = status, reason, headers, data

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
        self._buf = b""  # bytes received past the last reply
        self._pending: tuple[str, bool] | None = None  # (verb, close after) of the request sent, reply unread
        name = f"[{host}]" if ":" in host else host  # (an IPv6 literal)
        self._host_header = "localhost" if uds else (f"{name}:{port}" if port != 80 else name)

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
        self.sock, self._buf = sock, b""

    def close(self) -> None:
        sock, self.sock, self._pending, self._buf = self.sock, None, None, b""
        if sock is not None:
            sock.close()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> None:
        if self._pending is not None:
            raise http.client.CannotSendRequest("the previous reply was not read")
        if self.sock is None:
            self.connect()
        parts = [f"{method} {path} HTTP/1.1\r\nhost: {self._host_header}\r\n"]
        close = False
        for k, v in (headers or {}).items():
            parts.append(f"{k}: {v}\r\n")
            close = close or (k.lower() == "connection" and "close" in v.lower())
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
        self._pending = (method, close)

    def getresponse(self) -> Response:
        if self._pending is None:
            raise http.client.ResponseNotReady("no request was sent")
        method, close = self._pending
        try:
            resp, keep = self._read_reply(method)
        except BaseException:
            self.close()  # the connection's framing is lost
            raise
        self._pending = None
        if close or not keep:
            self.close()
        return resp

    # -- reading ----------------------------------------------------------------------------

    def _recv(self) -> bytes:
        assert self.sock is not None
        return self.sock.recv(1 << 16)

    def _read_reply(self, method: str) -> tuple[Response, bool]:
        buf = self._buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise http.client.LineTooLong("reply head")
            chunk = self._recv()
            if not chunk:
                if not buf:
                    raise http.client.RemoteDisconnected("Remote end closed connection without response")
                raise http.client.IncompleteRead(buf)
            buf += chunk
        lines = buf[:end].decode("latin-1").split("\r\n")
        rest = buf[end + 4 :]
        version, _, status_reason = lines[0].partition(" ")
        code, _, reason = status_reason.partition(" ")
        if not version.startswith("HTTP/") or not code.isdigit():
            raise http.client.BadStatusLine(lines[0][:100])
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if not sep:
                continue
            k, v = k.strip().lower(), v.strip()
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        if 100 <= status < 200:  # (a 100 Continue we did not ask for): the real reply follows
            self._buf = rest
            return self._read_reply(method)
        keep = version != "HTTP/1.0" and "close" not in headers.get("connection", "").lower()
        if method == "HEAD" or status in _NO_BODY:
            data = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            data, rest = self._chunked(rest)
        elif (length := headers.get("content-length")) is not None:
            if not length.strip().isdigit():
                raise http.client.HTTPException(f"bad content-length {length[:40]!r}")
            data, rest = self._exactly(rest, int(length))
        else:
            data, rest, keep = self._to_close(rest), b"", False
        self._buf = rest
        return Response(status, reason, headers, data), keep

    def _exactly(self, have: bytes, n: int) -> tuple[bytes, bytes]:
        if len(have) >= n:
            return have[:n], have[n:]
        data = bytearray(n)
        view = memoryview(data)
        view[: len(have)] = have
        got = len(have)
        assert self.sock is not None
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise http.client.IncompleteRead(bytes(data[:got]), n - got)
            got += k
        return bytes(data), b""

    def _line(self, have: bytes) -> tuple[bytes, bytes]:
        while (i := have.find(b"\r\n")) < 0:
            if len(have) > MAX_HEAD:
                raise http.client.LineTooLong("chunk size")
            chunk = self._recv()
            if not chunk:
                raise http.client.IncompleteRead(have)
            have += chunk
        return have[:i], have[i + 2 :]

    def _chunked(self, have: bytes) -> tuple[bytes, bytes]:
        parts = []
        while True:
            line, have = self._line(have)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise http.client.IncompleteRead(b"".join(parts)) from None
            if size == 0:
                while True:  # trailers, up to the empty line
                    line, have = self._line(have)
                    if not line:
                        return b"".join(parts), have
            chunk, have = self._exactly(have, size + 2)
            parts.append(chunk[:size])

    def _to_close(self, have: bytes) -> bytes:
        parts = [have]
        while chunk := self._recv():
            parts.append(chunk)
        return b"".join(parts)
