"""sidecar/client/http1.py against a real socket server scripted per test: framing, pipelining, failures, one send."""

from __future__ import annotations

import http.client
import socket
import threading
from typing import Callable, Iterator

import pytest

from sidecar.client.http1 import MAX_HEAD, Connection

Script = Callable[["Peer", socket.socket], None]


class Peer:
    """A loopback listener running `script(conn)` for each accepted connection, in a thread;
    `reads` keeps what each recv returned (the segments the client's writes arrived as)."""

    def __init__(self, *scripts: Script):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.reads: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, args=(scripts,), daemon=True)
        self._thread.start()

    def _serve(self, scripts: tuple[Script, ...]) -> None:
        for script in scripts:
            conn, _ = self.sock.accept()
            with conn:
                script(self, conn)

    def request(self, conn: socket.socket) -> bytes:
        """Read one request (head + content-length body); its recv chunks go to `reads`."""
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _request_size(data):
            chunk = conn.recv(65536)
            if not chunk:
                break
            self.reads.append(chunk)
            data += chunk
        return data

    def close(self) -> None:
        self._thread.join(5)
        self.sock.close()


def _request_size(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(head) + 4 + int(v)
    return len(head) + 4


def reply(*parts: bytes) -> Script:
    def script(me: Peer, conn: socket.socket) -> None:
        me.request(conn)
        for p in parts:
            conn.sendall(p)

    return script


@pytest.fixture
def peer() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(*scripts: Script) -> Peer:
        made.append(Peer(*scripts))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_request_goes_out_as_one_segment_and_the_reply_is_framed_by_content_length(peer: Callable[..., Peer]) -> None:
    seen: list[bytes] = []

    def script(me: Peer, conn: socket.socket) -> None:
        for _ in range(2):  # two calls on one kept-alive connection
            seen.append(me.request(conn))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Request-Id: a\r\nX-Two: 1\r\nx-two: 2\r\n\r\nhello")

    p = peer(script)
    c = Connection("127.0.0.1", p.port, timeout=5)
    for _ in range(2):
        c.request("POST", "/rpc/x", body=b"\x81\xa1a\x01", headers={"content-type": "application/msgpack"})
        r = c.getresponse()
        assert (r.status, r.read(), r.getheader("x-request-id"), r.getheader("X-TWO")) == (200, b"hello", "a", "1, 2")
    c.close()
    assert len(seen) == 2 and all(s.endswith(b"\r\n\r\n\x81\xa1a\x01") for s in seen)
    assert b"content-length: 4\r\n" in seen[0] and seen[0].startswith(b"POST /rpc/x HTTP/1.1\r\n")
    assert len(p.reads) == 2  # each request (head and body) arrived in a single read


def test_chunked_and_close_delimited_bodies_and_a_reply_split_across_segments(peer: Callable[..., Peer]) -> None:
    def chunked(me: Peer, conn: socket.socket) -> None:
        me.request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        conn.sendall(b"2;ext=1\r\nde\r\n0\r\nTrailer: x\r\n\r\n")
        me.request(conn)  # still kept alive
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-")
        conn.sendall(b"Length: 3\r\n\r\nx")
        conn.sendall(b"yz")

    def to_close(me: Peer, conn: socket.socket) -> None:
        me.request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")

    p = peer(chunked, to_close)
    c = Connection("127.0.0.1", p.port, timeout=5)
    c.request("GET", "/a")
    assert c.getresponse().read() == b"abcde"
    c.request("GET", "/b")
    assert c.getresponse().read() == b"xyz"
    c.close()
    c.request("GET", "/c")  # reconnects
    assert c.getresponse().read() == b"until the end"
    assert c.sock is None  # a close-delimited body ends the connection


def test_failures_are_http_clients_own_exceptions(peer: Callable[..., Peer]) -> None:
    def nothing(me: Peer, conn: socket.socket) -> None:
        me.request(conn)  # and close without a reply

    p = peer(nothing, reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"), reply(b"garbage\r\n\r\n"))
    c = Connection("127.0.0.1", p.port, timeout=5)
    c.request("POST", "/x", body=b"{}")
    with pytest.raises(http.client.RemoteDisconnected):
        c.getresponse()
    assert c.sock is None
    c.request("POST", "/x", body=b"{}")
    with pytest.raises(http.client.IncompleteRead):
        c.getresponse()
    c.request("POST", "/x", body=b"{}")
    with pytest.raises(http.client.BadStatusLine):
        c.getresponse()
    with pytest.raises(http.client.ResponseNotReady):
        c.getresponse()


def test_a_silent_server_times_out(peer: Callable[..., Peer]) -> None:
    done = threading.Event()

    def silent(me: Peer, conn: socket.socket) -> None:
        me.request(conn)
        done.wait(5)

    p = peer(silent)
    c = Connection("127.0.0.1", p.port, timeout=0.2)
    c.request("POST", "/x", body=b"{}")
    with pytest.raises(TimeoutError):
        c.getresponse()
    done.set()


def test_pipelined_replies_come_back_in_request_order_also_from_one_segment(peer: Callable[..., Peer]) -> None:
    def script(me: Peer, conn: socket.socket) -> None:
        data = b""
        while data.count(b"\r\n\r\n") < 3:
            data += conn.recv(65536)
        conn.sendall(b"".join(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % i for i in range(3)))

    p = peer(script)
    c = Connection("127.0.0.1", p.port, timeout=5)
    for i in range(3):
        c.request("GET", f"/{i}")  # no reply read in between
    assert c.outstanding == 3
    assert [c.getresponse().read() for _ in range(3)] == [b"0", b"1", b"2"]
    with pytest.raises(http.client.ResponseNotReady):
        c.getresponse()
    c.close()


def test_a_unix_socket_and_a_reply_head_over_the_bound(tmp_path) -> None:
    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()

    def serve() -> None:
        for head in (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD + 10)):
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(head)
                conn.recv(1)  # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = Connection(timeout=5, uds=path)
    c.request("GET", "/")
    assert c.getresponse().read() == b"ok"
    c.close()
    c.request("GET", "/")
    with pytest.raises(http.client.LineTooLong):
        c.getresponse()
    assert c.sock is None
    t.join(5)
    srv.close()
