"""server/connguard.py and the body budget (server/httpio.py) against a real server: what a client
can hold without sending a request (idle sockets, a trickled head or body, many connections, many
bodies just under the limit) is bounded; a call that is running is never cut by these bounds."""

from __future__ import annotations

import socket
import time

import httpx
import msgpack
import pytest

from tests.server.serverproc import finish, prefill, slow_prefill_tokens, start_server

READ_TIMEOUT = 0.3
BODY_LIMIT = 20000
MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def server(home: str):
    flags = ["--preload", "--idle-timeout", "0.3", "--read-timeout", str(READ_TIMEOUT), "--max-connections",
             str(MAX_CONNECTIONS), "--max-body-bytes", str(BODY_LIMIT), "--max-model-len", "4096",
             "--max-num-batched-tokens", "64", "--max-num-seqs", "2", "--max-logprobs", "512"]
    with start_server(*flags, env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s:
        s.addr = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))  # type: ignore[attr-defined]
        yield s


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets():
    yield
    while _OPEN:
        _OPEN.pop().close()


def connect(server) -> socket.socket:
    sock = socket.create_connection(server.addr, timeout=10)
    _OPEN.append(sock)
    return sock


def outcome(sock: socket.socket, wait: float = 10.0) -> tuple[bool, bytes]:
    """(closed by the server within `wait` s, everything it sent before)."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        return False, data
    except ConnectionResetError:
        pass
    return True, data


def post(method: str, body: bytes = b"", **headers: str) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST /rpc/{method} HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n{head}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def test_connections_without_a_request_are_closed(server) -> None:
    quiet = connect(server)
    trickle = connect(server)  # bytes that never make a request (blank lines between requests)
    for _ in range(3):
        trickle.sendall(b"\r\n")
        time.sleep(0.1)
    assert outcome(quiet) == (True, b"")
    with pytest.raises(OSError):
        for _ in range(100):
            trickle.sendall(b"\r\n")
            time.sleep(0.05)
    # after a reply, the kept-alive connection is closed the same way
    kept = connect(server)
    kept.sendall(post("check_health"))
    closed, data = outcome(kept)
    assert closed and data.startswith(b"HTTP/1.1 200") and data.endswith(b"\x81\xa6result\xc0")


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_trickled_request_is_408_and_never_runs(server, part: str) -> None:
    sock = connect(server)
    full = post("shutdown", b"\x80")  # shutdown would free the model if it ever ran
    cut = full.index(b"\r\n\r\n") + (4 if part == "body" else -10)
    sock.sendall(full[:cut])
    closed, data = outcome(sock)
    assert closed and data.startswith(b"HTTP/1.1 408 "), data
    body = data.split(b"\r\n\r\n", 1)[1]
    assert b'"type": "request_timeout"' in body and b"--read-timeout" in body
    assert httpx.get(f"{server.url}/readyz").status_code == 200  # (a shutdown that ran would free the model)
    ran = [ln for ln in httpx.get(f"{server.url}/metrics").text.splitlines()
           if ln.startswith("mlx_worker_rpc_requests_total") and 'method="shutdown"' in ln and '"200"' in ln]
    assert ran == []


def test_a_running_call_is_not_cut_by_the_read_timeout(server) -> None:
    """The negative control: a step longer than the read timeout, and a call queued behind it for
    that long, are both answered 200 on their connections."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        def execute(so: dict) -> httpx.Response:
            r = c.post("/rpc/execute_model", content=msgpack.packb({"scheduler_output": so}),
                       headers={"content-type": "application/msgpack"})
            assert r.status_code == 200, r.content
            return r

        n = slow_prefill_tokens(execute, 4 * READ_TIMEOUT, 4000)
        step, queued = connect(server), connect(server)
        t0 = time.monotonic()
        step.sendall(post("execute_model", msgpack.packb({"scheduler_output": prefill("long", n)})))
        time.sleep(0.05)
        queued.sendall(post("check_health"))
        s1, s2 = outcome(step, 60), outcome(queued, 60)
        took = time.monotonic() - t0
        assert s1[1].startswith(b"HTTP/1.1 200"), s1[1][:200]
        assert msgpack.unpackb(s1[1].split(b"\r\n\r\n", 1)[1])["result"]["req_ids"] == ["long"]
        assert s2[1].startswith(b"HTTP/1.1 200") and s2[1].endswith(b"\xc0"), s2[1][-50:]
        if took < 2 * READ_TIMEOUT:
            pytest.fail(f"the {n}-token step took {took:.2f}s: not longer than the read timeout, no control")
        execute(finish("long"))


def test_past_max_connections_the_longest_idle_one_is_closed(home: str) -> None:
    with start_server("--idle-timeout", "60", "--max-connections", str(MAX_CONNECTIONS),
                      env={"MLX_SIDECAR_AUTH_TOKEN": None}) as s:
        s.addr = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))  # type: ignore[attr-defined]
        idle = [connect(s) for _ in range(MAX_CONNECTIONS)]
        time.sleep(0.1)
        assert [outcome(x, 0.01)[0] for x in idle] == [False] * MAX_CONNECTIONS  # held while under the bound
        for _ in range(3):  # each new connection makes room for itself, and is served
            new = connect(s)
            new.sendall(post("check_health"))
            assert new.recv(65536).startswith(b"HTTP/1.1 200")
        got = [outcome(x, 0.05)[0] for x in idle]
        assert got == [True] * 3 + [False] * (MAX_CONNECTIONS - 3)


def test_bodies_held_at_once_are_bounded(server) -> None:
    """Four bodies just under the limit, each still arriving, hold the whole budget
    (4 x --max-body-bytes); a fifth is 503 + Retry-After; once they are gone a call fits again."""
    big = b"\x81\xa3pad\xc5" + (BODY_LIMIT - 9).to_bytes(2, "big") + b"\x00" * (BODY_LIMIT - 9)
    assert len(big) == BODY_LIMIT - 1
    holders = []
    for _ in range(4):
        s = connect(server)
        s.sendall(post("check_health", big)[:-2])  # all but the last bytes
        holders.append(s)
    time.sleep(0.05)
    fifth = connect(server)
    fifth.sendall(post("check_health", big))
    closed, data = outcome(fifth)
    assert data.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data, data[:300]
    assert b"4 x --max-body-bytes" in data
    for s in holders:  # the read timeout answers them (nothing ran)
        assert outcome(s)[1].startswith(b"HTTP/1.1 408")
    r = httpx.post(f"{server.url}/rpc/check_health", content=big, headers={"content-type": "application/msgpack"})
    assert r.status_code == 400 and msgpack.unpackb(r.content)["error"]["field"] == "pad"  # read whole, decoded


@pytest.mark.parametrize("where", ["url", "header"])
def test_a_request_head_is_bounded(server, where: str) -> None:
    """httptools alone buffers a request line or header without bound (a 200 MB URL: 400 MB held).
    Past 64 KiB of head: 431 and closed, after reading about that much; 32 KiB is served."""
    from sidecar.server.connguard import MAX_HEAD_BYTES

    big = b"q" * (4 * MAX_HEAD_BYTES)
    head = (b"POST /rpc/check_health?" + big + b" HTTP/1.1\r\n" if where == "url"
            else b"POST /rpc/check_health HTTP/1.1\r\nhost: x\r\nx-big: " + big)
    sock = connect(server)
    with pytest.raises(OSError):  # the server stops reading (and resets) long before 100 MiB
        for _ in range(400):
            sock.sendall(head)
    closed, data = outcome(sock)
    assert closed and data.startswith(b"HTTP/1.1 431 ") and b"header_too_large" in data, data[:200]
    ok = connect(server)
    ok.sendall(post("check_health", b"", **{"x-big": "a" * (MAX_HEAD_BYTES // 2)}))
    assert ok.recv(65536).startswith(b"HTTP/1.1 200")


def _fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_client_that_never_reads_its_reply_is_dropped(server) -> None:
    """A reply far past the transport's high-water mark (a prompt's logprobs), never read: its
    handler waits on it; the connection is dropped (its descriptor freed) after the read timeout,
    instead of being held, unevictable, for as long as the client likes."""
    base = _fds(server.pid)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffers fill
    sock.connect(server.addr)
    _OPEN.append(sock)
    so = prefill("unread", 1500)
    so["scheduled_new_reqs"][0]["sampling_params"]["prompt_logprobs"] = 512  # a reply of ~9 MB: past the kernel buffers
    sock.sendall(post("execute_model", msgpack.packb({"scheduler_output": so})))
    deadline = time.monotonic() + 30
    while _fds(server.pid) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds(server.pid) <= base, "the connection is still held"
    with httpx.Client(base_url=server.url) as c:  # the step itself ran; the worker serves on
        r = c.post("/rpc/execute_model", content=msgpack.packb({"scheduler_output": finish("unread")}),
                   headers={"content-type": "application/msgpack"})
        assert r.status_code == 200
        assert httpx.get(f"{server.url}/metrics").text.count("mlx_worker_running_requests 0.0") == 1
