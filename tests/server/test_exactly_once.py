"""Exactly-once steps over lost replies, against a real server: a reply lost on the wire (the
connection closed before it was read, or cut by a proxy) is recovered by resending the step, with
the same output and final tokens as without the loss; out-of-sequence steps are 409s."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import msgpack
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.server.serverproc import finish, free_port, prefill
from tests.server.prom import scrape, value

PROMPT = list(range(40, 61))
STEPS = 6  # prefill in two chunks, then decodes


@pytest.fixture
def server(shared_server):
    return shared_server


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def steps_total(s) -> float:
    return value(scrape(s.url), "mlx_worker_steps_total")


def rename(node: object, rid: str) -> object:
    if isinstance(node, dict):
        return {("RID" if k == rid else k): rename(v, rid) for k, v in node.items()}
    if isinstance(node, list):
        return [rename(v, rid) for v in node]
    return "RID" if node == rid else node


def run(execute, rid: str) -> tuple[list[dict], list[int]]:
    """STEPS driver steps of one request; the replies (with the id renamed) and its tokens."""
    d = Driver(execute, 16, 512)
    d.add(rid, PROMPT, blocks=list(range(100, 104)) if rid.endswith("b") else list(range(0, 4)))
    replies = []
    for _ in range(STEPS):
        reply = d.step(chunk=16)
        replies.append(rename(reply, rid))
    tokens = d.reqs[rid].out
    d.finish(rid)
    d.step()
    return replies, tokens


def post_step(s, so: dict, step_id: int, *, read: bool = True) -> dict | None:
    body = msgpack.packb({"scheduler_output": so, "step_id": step_id})
    if read:
        r = httpx.post(f"{s.url}/rpc/execute_model", content=body, headers={"content-type": "application/msgpack"})
        assert r.status_code == 200, r.content
        return msgpack.unpackb(r.content)["result"]
    # Send the whole step, wait until the server has applied it, hang up without reading the reply.
    before = steps_total(s)
    sock = socket.create_connection(host_port(s.url))
    sock.sendall(b"POST /rpc/execute_model HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while steps_total(s) == before:
        assert time.monotonic() < deadline, "the step was never applied"
        time.sleep(0.01)
    sock.close()
    return None


def test_a_lost_reply_resent_gives_the_same_output_and_tokens(server, oracle_model, home: str) -> None:
    plain = RemoteWorker(server.url)
    want_replies, want_tokens = run(lambda so: plain.call("execute_model", scheduler_output=so), "a")
    assert want_tokens == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, len(want_tokens))[0]
    counter = iter(range(1000, 2000))
    lost = {1, 3}  # the second prefill chunk (a sampled first token) and a decode

    def execute(so: dict) -> dict:
        i = next(counter)
        if i - 1000 in lost:
            assert post_step(server, so, i, read=False) is None
        return post_step(server, so, i)  # the resend: the kept reply, nothing applied twice

    before = steps_total(server)
    got_replies, got_tokens = run(execute, "b")
    assert got_replies == want_replies and got_tokens == want_tokens
    assert steps_total(server) - before == STEPS  # no step ran twice (the closing finish-only step runs no forward)
    # The negative control: the same resend unnumbered is applied again and rejected.
    so = prefill("c", 4)
    assert plain.call("execute_model", scheduler_output=so)["req_ids"] == ["c"]
    with pytest.raises(RemoteError) as e:
        plain.call("execute_model", scheduler_output=so)
    assert e.value.status == 400 and "already exists" in e.value.message
    plain.call("execute_model", scheduler_output=finish("c"))
    plain.close()


def test_an_out_of_sequence_step_is_a_409_naming_the_last_applied_step(server) -> None:
    assert post_step(server, prefill("seq", 4), 7)["req_ids"] == ["seq"]
    for wrong in (5, 6, 9):
        r = httpx.post(f"{server.url}/rpc/execute_model", content=msgpack.packb({"scheduler_output": finish("seq"),
                                                                               "step_id": wrong}),
                       headers={"content-type": "application/msgpack"})
        err = msgpack.unpackb(r.content)["error"]
        assert r.status_code == 409 and err["type"] == "step_out_of_sequence" and err["field"] == "step_id"
        assert err["last_step_id"] == 7 and "last applied step is 7" in err["message"]
    assert value(scrape(server.url), "mlx_worker_running_requests") == 1  # nothing ran
    assert post_step(server, finish("seq"), 8)["req_ids"] == []
    assert post_step(server, finish("seq"), 8)["req_ids"] == []  # a resend
    r = httpx.post(f"{server.url}/rpc/execute_model", content=msgpack.packb({"scheduler_output": finish("other"),
                                                                           "step_id": 8}),
                   headers={"content-type": "application/msgpack"})
    assert r.status_code == 409 and "different execute_model body" in msgpack.unpackb(r.content)["error"]["message"]
    # A cache re-initialisation drops the request state and the sequence with it.
    info = httpx.get(f"{server.url}/info").json()
    w = RemoteWorker(server.url)
    w.initialize_cache(info["num_blocks"])
    w.close()
    assert post_step(server, finish(), 3)["req_ids"] == []


class DroppingProxy:
    """TCP proxy in front of the server that, when armed, lets one request through, waits for the
    server's reply to start, and closes the client's connection without forwarding it."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream, self.port, self.armed, self.dropped = upstream, free_port(), False, 0
        self._sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.armed:
                    self.armed, self.dropped = False, self.dropped + 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._sock.close()


def test_remote_worker_resends_a_step_whose_reply_was_lost(server) -> None:
    proxy = DroppingProxy(host_port(server.url))
    try:
        remote = RemoteWorker(f"http://127.0.0.1:{proxy.port}", number_steps=True, pin_instance=True)
        ref = RemoteWorker(server.url)
        want, want_tokens = run(lambda so: ref.execute_model(so).__dict__, "d")
        before = steps_total(server)
        calls = iter(range(100))

        def execute(so: dict) -> dict:
            proxy.armed = next(calls) in (1, 4)
            return remote.execute_model(so).__dict__

        got, got_tokens = run(execute, "e")
        assert proxy.dropped == 2 and remote.resent == 2
        assert got == want and got_tokens == want_tokens
        assert steps_total(server) - before == STEPS
        # The negative control: an unnumbered worker's resend applies the step a second time.
        plain = RemoteWorker(f"http://127.0.0.1:{proxy.port}")
        proxy.armed = True
        with pytest.raises(RemoteError) as e:
            plain.execute_model(prefill("f", 4))
        assert e.value.status == 400 and "already exists" in e.value.message
        plain.execute_model(finish("f"))
        for w in (remote, ref, plain):
            w.close()
    finally:
        proxy.close()
