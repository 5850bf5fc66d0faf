from __future__ import annotations

import pytest

from sidecar.client import RemoteWorker
from tests.server.serverproc import free_port


def test_wait_while_starting_gives_up_on_a_server_that_never_listens() -> None:
    """Nothing listens on the port: it says what it waits for, then raises after connect_timeout."""
    seen: list[str] = []
    w = RemoteWorker(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectionRefusedError):
        w.wait_while_starting(seen.append, connect_timeout=0.3, poll=0.05)
    assert seen == [f"not accepting connections at {w.url} yet"]  # once, not once per poll
