"""The RPC route's HTTP details (sidecar/server/httpio.py): a client hanging up mid-body against a
real server, and the reply encoder's fallback envelope."""

from __future__ import annotations

import socket

import msgpack

from sidecar.server.httpio import encode_reply
from tests.server.test_hardening import call
from tests.server.prom import scrape, value


def test_an_unencodable_reply_becomes_a_500_envelope_not_a_bare_500() -> None:
    body, failed = encode_reply({"result": ["\ud800"]}, True)
    assert isinstance(failed, UnicodeEncodeError)
    err = msgpack.unpackb(body)["error"]
    assert err["type"] == "internal_error" and "could not be encoded" in err["message"] and err["message"].isascii()
    assert encode_reply({"result": ["\ud800"]}, False)[1] is None  # JSON escapes it
    assert encode_reply({"result": 1}, True) == (msgpack.packb({"result": 1}), None)


def test_a_client_hanging_up_mid_body_is_a_499_without_traceback(shared_server) -> None:
    server = shared_server
    host, port = server.url.removeprefix("http://").split(":")
    before = scrape(server.url)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /rpc/execute_model HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                     b"content-length: 100000\r\n\r\n" + b"\x81" * 100)
    for _ in range(200):
        after = scrape(server.url)
        if value(after, "mlx_worker_rpc_requests_total", method="execute_model", code="499") > value(
                before, "mlx_worker_rpc_requests_total", method="execute_model", code="499"):
            break
    else:
        raise AssertionError("the hang-up was not counted as a 499")
    assert value(after, "mlx_worker_errors_total", type="client_closed_request") >= 1
    assert value(after, "mlx_worker_errors_total", type="internal_error") == 0
    assert "Traceback" not in server.stderr() and "ClientDisconnect" not in server.stderr()
    assert call(server, "check_health").status_code == 200
