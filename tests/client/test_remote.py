from __future__ import annotations

import pytest

from sidecar.client.remote import RemoteWorker, connect
from tests.server.serverproc import free_port, start_server


def test_wait_while_starting_gives_up_on_a_server_that_never_listens() -> None:
    """Nothing listens on the port: it says what it waits for, then raises after connect_timeout."""
    seen: list[str] = []
    w = RemoteWorker(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectionRefusedError):
        w.wait_while_starting(seen.append, connect_timeout=0.3, poll=0.05)
    assert seen == [f"not accepting connections at {w.url} yet"]  # once, not once per poll


def test_pipelined_calls_on_one_connection_are_answered_in_order(home: str) -> None:
    """Against a real server: three requests sent before any reply is read come back in order."""
    with start_server(env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s:
        c = connect(s.url, 30)
        for i in range(3):
            c.request("POST", "/rpc/check_health", body=b"", headers={"x-request-id": f"r{i}"})
        replies = [c.getresponse() for _ in range(3)]
        c.close()
    assert [(r.status, r.getheader("x-request-id"), r.read()) for r in replies] == [
        (200, f"r{i}", b'{"result":null}') for i in range(3)]
