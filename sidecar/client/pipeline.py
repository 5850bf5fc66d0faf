"""Pipelined calls: send step n + 1 before step n's reply is read.

`connections=1` pipelines over one HTTP/1.1 connection (sidecar/client/http1.py): the order on the wire
is the order the server runs the calls in (uvicorn answers pipelined requests one after the other,
and steps run on its MLX thread in arrival order).

`connections=2` sends calls alternately over two connections instead, each execute_model numbered
(`step_id`; two empty steps, waited for, start the numbering): the server hands numbered steps to
its MLX thread in step order (server/sequencer.py), and it reads step n + 1 while step n computes.
No MLX.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgpack

from sidecar.client.remote import MSGPACK, connect, exec_seconds, result_of
from sidecar.client.http1 import Connection

EMPTY_STEP = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
    "req_ids": [], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [], "num_computed_tokens": [],
    "num_output_tokens": []}, "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0, "finished_req_ids": []}


class Pipeline:
    """`submit(method, **kwargs)` sends a call; `collect()` reads the oldest outstanding reply
    (its result, or raises RemoteError). Nothing is resent: a lost connection raises OSError or
    http.client's exception for it."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0, connections: int = 1):
        if connections not in (1, 2):
            raise ValueError("connections must be 1 (HTTP/1.1 pipelining) or 2")
        self.outstanding: deque[Connection] = deque()  # the connection of each call sent, reply not read yet
        self.last_exec_seconds: float | None = None
        self.next_step_id: int | None = None  # numbered execute_model calls (two connections only)
        self._conns = [connect(url, timeout) for _ in range(connections)]
        self._headers = {"content-type": MSGPACK}  # (the reply comes in the request's format)
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._sent = 0
        if connections == 2:
            # An unnumbered empty step ends whatever numbering the server's step ledger holds (wire/steps.py);
            # a numbered empty step 1, waited for, starts ours, so the server knows which step comes next
            # before two are in flight (the first two could otherwise arrive swapped).
            self.submit("execute_model", scheduler_output=EMPTY_STEP)
            self.collect()
            self.submit("execute_model", scheduler_output=EMPTY_STEP, step_id=1)
            self.collect()
            self.next_step_id = 2

    def submit(self, method: str, **kwargs: Any) -> None:
        if method == "execute_model" and self.next_step_id is not None and "step_id" not in kwargs:
            kwargs["step_id"] = self.next_step_id
            self.next_step_id += 1
        conn = self._conns[self._sent % len(self._conns)]
        self._sent += 1
        conn.request("POST", f"/rpc/{method}", body=msgpack.packb(kwargs, use_bin_type=True), headers=self._headers)
        self.outstanding.append(conn)

    def collect(self) -> Any:
        if not self.outstanding:
            raise RuntimeError("collect: no call is outstanding")
        resp = self.outstanding.popleft().getresponse()
        self.last_exec_seconds = exec_seconds(resp)
        return result_of(resp, resp.read())

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
