"""End to end: a real `mlx-sidecar serve` on a free port, driven through RemoteWorker, raw msgpack
POSTs and stdlib JSON; bad input gets the right 4xx and changes nothing."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import httpx
import msgpack
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.server.serverproc import start_server

MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module")
def server(home: str, tmp_path_factory: pytest.TempPathFactory):
    from tests.engine.test_lora import make_adapter

    loras = tmp_path_factory.mktemp("app") / "loras"
    make_adapter(home, loras / "one", seed=1)
    with start_server("--max-body-bytes", "2000000", "--lora-dir", str(loras)) as s:
        yield s


@pytest.fixture(scope="module")
def remote(server):
    w = RemoteWorker(server.url)
    w.init_device()
    w.load_model()
    yield w
    w.close()


def post(url: str, method: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/rpc/{method}", content=body, headers=headers or MSGPACK, timeout=60)


def test_lifecycle_over_remote_worker(server, remote: RemoteWorker, oracle_model) -> None:
    assert httpx.get(f"{server.url}/readyz").status_code == 503
    free = remote.determine_available_memory()
    assert free > 0
    spec = remote.get_kv_cache_spec()
    assert sorted(spec) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    per_block = remote.get_cache_block_size_bytes()
    assert per_block == sum(s["page_size_bytes"] for s in spec.values())
    remote.initialize_cache(num_gpu_blocks=min(256, free // per_block))
    assert remote.compile_or_warm_up_model() == 0.0  # the memory profile ran these forwards already
    remote.check_health()
    model = remote.get_model()
    assert model["type"] == "llama" and model["path"].endswith("tiny-v2")
    assert remote.vocab_size() == 512
    assert httpx.get(f"{server.url}/readyz").status_code == 200
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 256)
    prompt = list(range(5, 45))
    d.add("e2e", prompt)
    assert d.run(10)["e2e"] == mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 10)[0]
    d.finish("e2e")
    d.step()


def test_out_of_order_lifecycle_is_409(remote: RemoteWorker) -> None:
    with pytest.raises(RemoteError) as e:
        remote.load_model()  # already loaded: needs a new init_device first
    assert e.value.status == 409 and "init_device" in e.value.message


def test_raw_msgpack_and_stdlib_json(server, remote: RemoteWorker) -> None:
    r = post(server.url, "vocab_size", b"")
    assert r.status_code == 200 and msgpack.unpackb(r.content) == {"result": 512}
    assert re.fullmatch(r"exec;dur=\d+\.\d{3}", r.headers["server-timing"])
    remote.vocab_size()
    assert 0 <= remote.last_exec_seconds < 1
    req = urllib.request.Request(f"{server.url}/rpc/get_cache_block_size_bytes", data=b"{}", method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        assert json.loads(resp.read()) == {"result": remote.get_cache_block_size_bytes()}
    # A JSON body can ask for a msgpack reply.
    r = httpx.post(f"{server.url}/rpc/vocab_size", content=b"{}",
                   headers={"content-type": "application/json", "accept": "application/msgpack"})
    assert msgpack.unpackb(r.content) == {"result": 512}


def test_json_execute_model_with_stdlib(server, remote: RemoteWorker) -> None:
    so = {"scheduled_new_reqs": [{"req_id": "j", "prompt_token_ids": [3, 4, 5], "sampling_params": {"temperature": 0},
                                  "block_ids": [[7]], "num_computed_tokens": 0}],
          "num_scheduled_tokens": {"j": 3}, "total_num_scheduled_tokens": 3}
    req = urllib.request.Request(f"{server.url}/rpc/execute_model", data=json.dumps({"scheduler_output": so}).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        out = json.loads(resp.read())["result"]
    assert out["req_ids"] == ["j"] and len(out["sampled_token_ids"][0]) == 1
    remote.call("execute_model", scheduler_output={"num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                                                   "finished_req_ids": ["j"]})


def _bad_calls(url: str) -> list[tuple[int, str | None, httpx.Response]]:
    """(expected status, expected field, response) for a zoo of bad calls."""
    good_new = {"req_id": "innocent", "prompt_token_ids": [5, 6], "sampling_params": {}, "block_ids": [[40]],
                "num_computed_tokens": 0}

    def so(**kw: object) -> bytes:
        d = {"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0}
        d.update(kw)
        return msgpack.packb({"scheduler_output": d})

    bad_block = dict(good_new, req_id="b1", block_ids=[[10**6]])
    return [
        (400, None, post(url, "execute_model", b"\xc1\xc1\xc1")),
        (400, "scheduler_output", post(url, "execute_model", msgpack.packb({"scheduler_output": [1]}))),
        (400, "scheduled_new_reqs[1].block_ids[0][0]", post(url, "execute_model", so(
            scheduled_new_reqs=[good_new, bad_block], num_scheduled_tokens={"innocent": 2, "b1": 2}, total_num_scheduled_tokens=4))),
        (400, "scheduled_cached_reqs.req_ids[0]", post(url, "execute_model", so(
            scheduled_cached_reqs={"req_ids": ["ghost"], "new_block_ids": [None], "new_token_ids": [[]],
                                   "num_computed_tokens": [0]},
            num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1))),
        (400, "scheduled_new_reqs[0].prompt_token_ids[1]", post(url, "execute_model", so(
            scheduled_new_reqs=[dict(good_new, prompt_token_ids=[5, 99999])], num_scheduled_tokens={"innocent": 2},
            total_num_scheduled_tokens=2))),
        (400, "bogus", post(url, "execute_model", msgpack.packb({"scheduler_output": {}, "bogus": 1}))),
        (400, "num_gpu_blocks", post(url, "initialize_cache", msgpack.packb({"num_gpu_blocks": "many"}))),
        (409, None, post(url, "load_model", b"")),
        (404, None, post(url, "__init__", b"")),
        (404, None, post(url, "no_such_method", b"")),
        (405, None, httpx.get(f"{url}/rpc/execute_model")),
        (415, None, post(url, "execute_model", b"x=1", {"content-type": "application/x-www-form-urlencoded"})),
        (413, None, post(url, "execute_model", b"\x00" * 2_000_001)),
    ]


def test_bad_input_is_rejected_and_changes_nothing(server, remote: RemoteWorker, oracle_model) -> None:
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, 256)
    d.free = list(range(100, 256))
    prompts = {"p": list(range(10, 30)), "q": [7, 8, 9]}
    for rid, p in prompts.items():
        d.add(rid, p)
    d.step()
    d.step()
    for status, field, r in _bad_calls(server.url):
        assert r.status_code == status, (status, r.content[:300])
        ctype = r.headers["content-type"]
        err = (msgpack.unpackb(r.content) if "msgpack" in ctype else r.json())["error"]
        assert err["message"] and err["type"]
        if field is not None:
            assert err["field"] == field, err
    # The valid request in the rejected batch was not registered: it may be sent again.
    assert remote.call("execute_model", scheduler_output={
        "scheduled_new_reqs": [{"req_id": "innocent", "prompt_token_ids": [5, 6], "sampling_params": {},
                                "block_ids": [[40]], "num_computed_tokens": 0}],
        "num_scheduled_tokens": {"innocent": 2}, "total_num_scheduled_tokens": 2})["req_ids"] == ["innocent"]
    got = d.run(8)
    for rid, p in prompts.items():
        assert got[rid] == mlx_lm_greedy(oracle_model("builtin:tiny"), p, 8)[0]
    assert remote.check_health() is None


def test_shutdown_then_init_device_starts_over(home: str) -> None:
    with start_server() as s:
        w = RemoteWorker(s.url)
        w.init_device()
        w.load_model()
        w.initialize_cache(num_gpu_blocks=16)
        w.shutdown()
        with pytest.raises(RemoteError) as e:
            w.vocab_size()
        assert e.value.status == 409
        w.init_device()
        w.load_model()
        assert w.vocab_size() == 512
        w.close()


def test_sampling_params_end_to_end_over_msgpack(server, remote: RemoteWorker, make_worker) -> None:
    """Per-request sampling through the server equals the in-process worker's, row for row."""
    prompt = list(range(20, 36))
    rows = {
        "greedy": {"temperature": 0.0, "logprobs": 3},
        "seeded": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7, "logprobs": 1},
        "penalised": {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2},
        "biased": {"temperature": 0.8, "seed": 3, "logit_bias": {42: 100.0}},  # int keys travel as msgpack ints
        "min_p": {"temperature": 1.2, "min_p": 0.2, "seed": 11, "prompt_logprobs": 2},
    }

    def run(execute) -> dict:
        d = Driver(execute, 16, 256)
        d.free = list(range(150, 256))
        for rid, params in rows.items():
            d.add(rid, prompt, params)
        got = d.run(6)
        for rid in list(d.reqs):
            d.finish(rid)
        d.step()
        return got

    over_http = run(lambda so: remote.call("execute_model", scheduler_output=so))
    in_process = run(make_worker().execute_model)
    assert over_http == in_process
    assert over_http["biased"] == [42] * 6
    assert over_http["greedy"] != over_http["penalised"] or over_http["greedy"] != over_http["seeded"]


def test_json_logit_bias_uses_string_keys(server, remote: RemoteWorker) -> None:
    so = {"scheduled_new_reqs": [{"req_id": "lb", "prompt_token_ids": [3, 4], "sampling_params": {
        "temperature": 0, "logit_bias": {"99": 50.0}}, "block_ids": [[9]], "num_computed_tokens": 0}],
        "num_scheduled_tokens": {"lb": 2}, "total_num_scheduled_tokens": 2, "finished_req_ids": []}
    r = httpx.post(f"{server.url}/rpc/execute_model", json={"scheduler_output": so})
    assert r.status_code == 200 and r.json()["result"]["sampled_token_ids"] == [[99]]
    remote.call("execute_model", scheduler_output={"num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                                                   "finished_req_ids": ["lb"]})
    so["scheduled_new_reqs"][0]["sampling_params"]["logit_bias"] = {"100000": 1.0}
    r = httpx.post(f"{server.url}/rpc/execute_model", json={"scheduler_output": so})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "scheduled_new_reqs[0].sampling_params.logit_bias[100000]"


def test_lora_calls_over_http(remote: RemoteWorker) -> None:
    assert remote.add_lora({"lora_int_id": 1, "lora_name": "one", "lora_path": "one"}) is True
    assert remote.list_loras() == [1] and remote.pin_lora(1) is True
    with pytest.raises(RemoteError) as e:
        remote.add_lora({"lora_int_id": 2, "lora_name": "x", "lora_path": "../../etc"})
    assert e.value.status == 400 and e.value.field == "lora_request.lora_path"
    assert remote.remove_lora(1) is True and remote.list_loras() == []
