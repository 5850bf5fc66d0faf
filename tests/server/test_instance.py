"""Server instance ids against a real server: every reply names the instance, a caller pinned to
another instance gets 409 before anything runs, and another start is another instance."""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from tests.server.serverproc import finish, prefill, start_server
from tests.server.prom import scrape, value


@pytest.fixture
def server(shared_server):
    return shared_server


def test_every_reply_names_the_instance_and_a_mismatch_is_a_409(server, home: str) -> None:
    info = httpx.get(f"{server.url}/info").json()
    iid = info["instance_id"]
    assert len(iid) == 32 and info["started_at"] <= time.time()
    for r in (httpx.get(f"{server.url}/healthz"), httpx.get(f"{server.url}/readyz"), httpx.get(f"{server.url}/metrics"),
              httpx.post(f"{server.url}/rpc/check_health"), httpx.post(f"{server.url}/rpc/nope"),
              httpx.get(f"{server.url}/nothing-here")):
        assert r.headers["x-sidecar-instance"] == iid, r
    assert httpx.get(f"{server.url}/readyz").json()["instance_id"] == iid
    text = scrape(server.url)
    assert value(text, "mlx_worker_start_time_seconds", instance_id=iid) == info["started_at"]
    body = msgpack.packb({"scheduler_output": prefill("inst", 4)})
    headers = {"content-type": "application/msgpack", "x-sidecar-expect-instance": "0" * 32}
    r = httpx.post(f"{server.url}/rpc/execute_model", content=body, headers=headers)
    err = msgpack.unpackb(r.content)["error"]
    assert r.status_code == 409 and err["type"] == "instance_mismatch" and iid in err["message"], err
    assert value(scrape(server.url), "mlx_worker_running_requests") == 0  # nothing ran
    headers["x-sidecar-expect-instance"] = iid
    assert httpx.post(f"{server.url}/rpc/execute_model", content=body, headers=headers).status_code == 200
    w = RemoteWorker(server.url)
    w.execute_model(finish("inst"))
    w.close()
    # Another start is another instance; a worker pinned to the first one notices.
    pinned = RemoteWorker(server.url, pin_instance=True)
    pinned.check_health()
    assert pinned.instance_id == iid
    with start_server() as other:
        pinned.url = other.url
        pinned.close()
        with pytest.raises(RemoteError) as e:
            pinned.check_health()
        assert e.value.status == 409 and e.value.type == "instance_mismatch"
        assert httpx.get(f"{other.url}/info").json()["instance_id"] != iid
        pinned.close()


def test_info_keeps_every_protocol_2_key(server) -> None:
    """Clients of protocol 2 read these keys; a field no longer measured stays, as null."""
    info = httpx.get(f"{server.url}/info").json()
    keys = {"version", "protocol_version", "state", "model", "model_path", "device", "mlx_version", "kv_cache_spec",
            "num_blocks", "block_size", "max_model_len", "vocab_size", "busy", "queue_depth",
            "mlx_thread_idle_seconds", "decode_ahead", "device_idle", "draining", "instance_id", "started_at",
            "starting", "speculative_method"}
    assert keys <= info.keys(), keys - info.keys()
    assert info["device_idle"] is None
