"""Pipelined calls over one HTTP/1.1 connection: send step n + 1 before step n's reply is read.

HTTP/1.1 pipelining keeps the order on the wire, so the server runs the calls in the order they
were sent (uvicorn answers pipelined requests one after the other, and steps run on its MLX
thread in arrival order); a second connection would need the server to re-order them. The
standard library's client refuses a second request before the first response is read, so this
is a minimal client of its own: Content-Length bodies only (all the server sends).

`connections=2` sends calls alternately over two standard-library connections instead, each
execute_model numbered (`step_id`; two empty steps, waited for, start the numbering): the server
hands numbered steps to its MLX thread in step order (server/sequencer.py), and it reads step n + 1 while step n computes. No MLX.
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any
from urllib.parse import urlparse

import msgpack

from sidecar.client import MSGPACK, RemoteError
from sidecar.http1 import Connection

EMPTY_STEP = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
    "req_ids": [], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [], "num_computed_tokens": [],
    "num_output_tokens": []}, "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0, "finished_req_ids": []}


class Pipeline:
    """`submit(method, **kwargs)` sends a call; `collect()` reads the oldest outstanding reply
    (its result, or raises RemoteError). Nothing is resent: a lost connection raises OSError."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0, connections: int = 1):
        if connections not in (1, 2):
            raise ValueError("connections must be 1 (HTTP/1.1 pipelining) or 2")
        u = urlparse(url)
        self.outstanding: deque[Any] = deque()  # (connection or None) per call sent, replies not read yet
        self.last_exec_seconds: float | None = None
        self.next_step_id: int | None = None  # numbered execute_model calls (two connections only)
        self._conns: list[Connection] = []
        if connections == 2:
            from sidecar.client import RemoteWorker

            self._conns = [RemoteWorker(url, token, timeout)._connection() for _ in range(2)]
            self._headers = {"content-type": MSGPACK}  # (the reply comes in the request's format)
            if token:
                self._headers["authorization"] = f"Bearer {token}"
            self._sent = 0
            # An unnumbered empty step ends whatever numbering the server's step ledger holds (steps.py);
            # a numbered empty step 1, waited for, starts ours, so the server knows which step comes next
            # before two are in flight (the first two could otherwise arrive swapped).
            self.submit("execute_model", scheduler_output=EMPTY_STEP)
            self.collect()
            self.submit("execute_model", scheduler_output=EMPTY_STEP, step_id=1)
            self.collect()
            self.next_step_id = 2
            return
        if u.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = u.path
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            address = (u.hostname or "127.0.0.1", u.port or 80)
        self.sock.settimeout(timeout)
        self.sock.connect(address)
        auth = f"authorization: Bearer {token}\r\n" if token else ""
        self._head = f"host: {u.hostname or 'localhost'}\r\ncontent-type: {MSGPACK}\r\n{auth}"
        self._buf = bytearray()

    def submit(self, method: str, **kwargs: Any) -> None:
        if method == "execute_model" and self.next_step_id is not None and "step_id" not in kwargs:
            kwargs["step_id"] = self.next_step_id
            self.next_step_id += 1
        body = msgpack.packb(kwargs, use_bin_type=True)
        if self._conns:
            conn = self._conns[self._sent % 2]
            self._sent += 1
            conn.request("POST", f"/rpc/{method}", body=body, headers=self._headers)
            self.outstanding.append(conn)
            return
        self.sock.sendall(f"POST /rpc/{method} HTTP/1.1\r\n{self._head}content-length: {len(body)}\r\n\r\n".encode()
                          + body)
        self.outstanding.append(None)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection with replies outstanding")
        self._buf += chunk

    def collect(self) -> Any:
        if not self.outstanding:
            raise RuntimeError("collect: no call is outstanding")
        if self.outstanding[0] is not None:
            resp = self.outstanding.popleft().getresponse()
            return self._result(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers.get("content-length", "0"))
        while len(self._buf) < end + 4 + size:
            self._fill()
        data = bytes(self._buf[end + 4 : end + 4 + size])
        del self._buf[: end + 4 + size]
        self.outstanding.popleft()
        return self._result(status, headers, data)

    def _result(self, status: int, headers: dict[str, str], data: bytes) -> Any:
        timing = headers.get("server-timing", "")
        self.last_exec_seconds = float(timing.split("dur=", 1)[1]) / 1e3 if "dur=" in timing else None
        payload = msgpack.unpackb(data, raw=False, strict_map_key=False) if data else {}
        if status != 200:
            err = payload.get("error", {}) if isinstance(payload, dict) else {}
            raise RemoteError(status, err.get("type", "http_error"), err.get("message", data[:200].decode(errors="replace")),
                              err.get("field"))
        return payload["result"]

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        if not self._conns:
            self.sock.close()
