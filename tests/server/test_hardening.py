"""Issue 9's findings, each against a real server: abuse of the wire format, of the configuration
and of the LoRA directory gets a 4xx naming the field (never a 500), changes nothing, and costs
only what its bytes cost."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgpack
import pytest

from tests.server.serverproc import finish, prefill, start_server
from tests.server.prom import scrape, value

MP = "application/msgpack"


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture
def lora_root(shared_lora_root: Path) -> Path:
    return shared_lora_root


def post(s, method: str, body: bytes, ctype: str = MP, **headers: str) -> httpx.Response:
    return httpx.post(f"{s.url}/rpc/{method}", content=body, headers={"content-type": ctype, **headers}, timeout=60)


def call(s, method: str, **kwargs: object) -> httpx.Response:
    return post(s, method, msgpack.packb(kwargs))


def error(r: httpx.Response) -> dict:
    body = msgpack.unpackb(r.content) if "msgpack" in r.headers["content-type"] else r.json()
    return body["error"]


def running(s) -> float:
    return value(scrape(s.url), "mlx_worker_running_requests")


def rejected(r: httpx.Response, field: str | None, *words: str, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.content[:300])
    e = error(r)
    assert e["field"] == field, e
    for w in words:
        assert w in e["message"], e
    return e


def test_non_string_map_keys_are_400_on_every_method(server) -> None:
    nested = b"\x81" + msgpack.packb("scheduler_output") + b"\x81\x91\x01\x01"
    for method in ("check_health", "execute_model", "init_device", "add_lora"):
        for body in (b"\x81\x91\x01\x01", bytes.fromhex("8181a1610101"), b"\x81\xc0\x01",
                     b"\x81\xcb" + b"\0" * 8 + b"\x01", nested):
            rejected(post(server, method, body), None, "map keys must be strings")
    # An int key only inside logit_bias: elsewhere 400, there accepted (the negative control).
    so = prefill("intkey", 4)
    so["scheduled_new_reqs"][0]["sampling_params"]["logit_bias"] = {7: 1.5}
    assert call(server, "execute_model", scheduler_output=so).status_code == 200
    bad = finish("intkey")
    bad["num_scheduled_tokens"] = {3: 1}
    rejected(call(server, "execute_model", scheduler_output=bad), "num_scheduled_tokens",
             "got integer 3")
    assert call(server, "execute_model", scheduler_output=finish("intkey")).status_code == 200
    assert running(server) == 0


def test_lone_surrogate_ids_are_rejected_before_anything_changes(server) -> None:
    text = json.dumps({"scheduler_output": prefill("\ud800", 4)})  # json.dumps escapes it as \ud800
    assert "\\ud800" in text
    for accept in (MP, "application/json"):
        r = post(server, "execute_model", text.encode(), "application/json", accept=accept)
        assert r.status_code == 400, r.content
        e = error(r)
        assert "lone UTF-16 surrogate" in e["message"] and e["field"] in (
            "scheduled_new_reqs[0].req_id", "num_scheduled_tokens"), e
        assert r.headers["content-type"] == (MP if accept == MP else "application/json")
    assert running(server) == 0
    # Raw UTF-8-encoded surrogates and non-UTF-8 JSON are malformed bodies.
    rejected(post(server, "check_health", b'{"a": "\xed\xa0\x80"}', "application/json"), None, "malformed JSON")
    rejected(post(server, "check_health", '{"a": 1}'.encode("utf-16"), "application/json"), None, "malformed JSON")
    # The negative control: a valid non-ASCII id round-trips both formats.
    ok = post(server, "execute_model", json.dumps({"scheduler_output": prefill("\U0001f600-é", 4)}).encode(),
              "application/json", accept=MP)
    assert ok.status_code == 200 and msgpack.unpackb(ok.content)["result"]["req_ids"] == ["\U0001f600-é"]
    assert call(server, "execute_model", scheduler_output=finish("\U0001f600-é")).status_code == 200


def test_duplicate_keys_are_rejected_in_both_formats(server) -> None:
    key = msgpack.packb("scheduler_output")
    body = b"\x82" + key + msgpack.packb(finish()) + key + msgpack.packb(prefill("dup", 4))
    rejected(post(server, "execute_model", body), None, "duplicate map key 'scheduler_output'")
    text = '{"scheduler_output": %s, "scheduler_output": %s}' % (json.dumps(finish()), json.dumps(prefill("dup", 4)))
    rejected(post(server, "execute_model", text.encode(), "application/json"), None, "duplicate map key")
    inner = json.dumps(prefill("dup", 4)).replace('"total_num_scheduled_tokens": 4', '"total_num_scheduled_tokens": 4, '
                                                  '"total_num_scheduled_tokens": 4')
    rejected(post(server, "execute_model", ('{"scheduler_output": %s}' % inner).encode(), "application/json"), None,
             "duplicate map key 'total_num_scheduled_tokens'")
    assert running(server) == 0


def test_ext_types_and_the_timestamp_ext_are_rejected(server) -> None:
    so = prefill("ts", 4)
    so["scheduled_new_reqs"][0]["sampling_params"]["seed"] = msgpack.Timestamp(1, 2)
    rejected(call(server, "execute_model", scheduler_output=so),
             "scheduled_new_reqs[0].sampling_params.seed", "timestamp ext (type -1)")
    rejected(call(server, "check_health", x=[msgpack.Timestamp(5)]), "x[0]", "timestamp")
    rejected(post(server, "check_health", msgpack.packb({"x": msgpack.ExtType(3, b"ab")})), "x", "ext type 3")
    assert running(server) == 0


def test_messages_name_wire_types_and_null_means_default(server) -> None:
    big = float(2**53)
    so = prefill("types", 4)
    so["scheduled_new_reqs"][0]["sampling_params"]["seed"] = big
    rejected(call(server, "execute_model", scheduler_output=so),
             "scheduled_new_reqs[0].sampling_params.seed", "got float 9007199254740992.0")
    rejected(call(server, "execute_model", scheduler_output=[]), "scheduler_output", "expected map, got array")
    so = prefill("types", 4)
    so["num_scheduled_tokens"] = [4]
    rejected(call(server, "execute_model", scheduler_output=so), "num_scheduled_tokens", "got array")
    rejected(call(server, "initialize_cache", num_gpu_blocks=None), "num_gpu_blocks", "expected integer, got null")
    rejected(call(server, "sleep", level=1.0), "level", "got float 1.0")
    rejected(call(server, "sleep", level={}), "level", "got map")
    for r in (call(server, "sleep", level=9), call(server, "profile", is_start="yes")):
        assert "NoneType" not in r.text and "str" not in error(r)["message"].split()
    # null: the parameter's default
    info = httpx.get(f"{server.url}/info").json()
    assert call(server, "sleep", level=None).status_code == 200
    assert httpx.get(f"{server.url}/info").json()["state"] == "sleeping"
    assert call(server, "wake_up", tags=None).status_code == 200
    assert call(server, "initialize_cache", num_gpu_blocks=info["num_blocks"], num_cpu_blocks=None).status_code == 200
    assert call(server, "init_device", config=None).status_code == 409  # reached the state check
    assert httpx.get(f"{server.url}/info").json()["state"] == "cache_ready"


def test_bounds_are_checked_by_shape_before_decoding(server) -> None:
    so = prefill("big", 4)
    so["scheduled_new_reqs"][0]["block_ids"] = [list(range(10**6))]
    rejected(call(server, "execute_model", scheduler_output=so), "scheduled_new_reqs[0].block_ids[0]",
             "1000000 blocks is over the limit of 20")
    so["scheduled_new_reqs"][0]["block_ids"] = [[]] * 10**6  # 1 MB, a million KV cache groups
    rejected(call(server, "execute_model", scheduler_output=so), "scheduled_new_reqs[0].block_ids",
             "1000000 entries, the limit is 16")
    rejected(call(server, "execute_model", scheduler_output=prefill("x" * 65, 4)), "scheduled_new_reqs[0].req_id",
             "65 characters is over the limit of 64")
    # live requests: 4 fit (and a 64-character id), a fifth does not; finishing one makes room.
    steps = [prefill(("r%d" % i).ljust(64, "-"), 4, first_block=i) for i in range(5)]
    for so in steps[:4]:
        assert call(server, "execute_model", scheduler_output=so).status_code == 200
    rejected(call(server, "execute_model", scheduler_output=steps[4]), "scheduled_new_reqs", "over the limit of 4")
    assert running(server) == 4
    assert value(scrape(server.url), "mlx_worker_kv_cache_blocks_used") == 4  # published by the MLX thread
    both = {**steps[4], "finished_req_ids": [steps[0]["scheduled_new_reqs"][0]["req_id"]]}
    assert call(server, "execute_model", scheduler_output=both).status_code == 200
    # a table grown past max_model_len's blocks by appends
    rid = steps[1]["scheduled_new_reqs"][0]["req_id"]
    grow = {"scheduled_cached_reqs": {"req_ids": [rid], "new_token_ids": [[]], "new_block_ids": [[list(range(100, 120))]],
                                      "num_computed_tokens": [4]}, "num_scheduled_tokens": {rid: 1},
            "total_num_scheduled_tokens": 1}
    rejected(call(server, "execute_model", scheduler_output=grow), "scheduled_cached_reqs.new_block_ids[0][0]",
             "21 blocks is over the limit of 20")
    ids = [so["scheduled_new_reqs"][0]["req_id"] for so in steps[1:]]
    assert call(server, "execute_model", scheduler_output=finish(*ids)).status_code == 200
    assert running(server) == 0


def test_lora_files_are_confined_and_bad_adapters_are_4xx_without_server_paths(server, lora_root: Path) -> None:
    def add(path: str, lora_id: int = 5) -> httpx.Response:
        return call(server, "add_lora", lora_request={"lora_int_id": lora_id, "lora_name": "x", "lora_path": path})

    cases = {"linked_weights": "outside the LoRA directory", "linked_config": "outside the LoRA directory",
             "a\x00b": "NUL", "a/" * 2500: "too long", "b" * 300: "too long", "badjson": "adapter_config.json",
             "notamap": "adapter_config.json", "garbage": "not a valid safetensors file",
             "hugeconfig": "adapter_config.json is over 1 MiB", "fifo": "not an mlx-lm adapter directory",
             "loop": "not an mlx-lm adapter directory"}
    for path, words in cases.items():
        e = rejected(add(path), "lora_request.lora_path", words)
        assert str(lora_root) not in e["message"] and str(lora_root.parent) not in e["message"], e
        assert "/tmp" not in e["message"] and len(e["message"]) < 300, e
    assert call(server, "list_loras").content == msgpack.packb({"result": []})
    assert msgpack.unpackb(add("good").content)["result"] is True  # the negative control


def test_init_device_takes_only_safe_overrides_and_a_bad_model_is_4xx(home: str, tmp_path: Path) -> None:
    notamodel = tmp_path / "notamodel"
    notamodel.mkdir()
    (notamodel / "config.json").write_text('{"model_type": "llama"')
    with start_server("--model", str(notamodel), "--log-level", "trace") as s:
        for key, v in [("lora_dir", "/"), ("model", "/"), ("home", "/tmp"), ("auth_token_file", "/dev/null"),
                       ("uds", "/tmp/x.sock"), ("max_body_bytes", 10**9), ("max_live_requests", 10**6),
                       ("allow_insecure", True), ("host", "0.0.0.0"), ("nope", 1)]:
            rejected(call(s, "init_device", config={key: v}), f"config.{key}", repr(key), "cannot be set by init_device")
            assert httpx.get(f"{s.url}/info").json()["state"] == "created"
        rejected(call(s, "init_device", config={"block_size": 2.0}), "config.block_size", "must be integer, got float 2.0")
        assert call(s, "init_device", config={"block_size": 32, "max_model_len": None}).status_code == 200
        e = rejected(call(s, "load_model"), "config.model", "cannot be loaded")
        assert str(tmp_path) not in e["message"]
        assert httpx.get(f"{s.url}/info").json()["state"] == "device_ready"
        assert call(s, "init_device", config={"model": "builtin:nope"}).status_code == 200
        rejected(call(s, "load_model"), "config.model", "cannot be loaded")
        assert call(s, "init_device", config={"model": "builtin:tiny"}).status_code == 200
        assert call(s, "load_model").status_code == 200
        assert httpx.get(f"{s.url}/info").json()["block_size"] == 32
        assert s.stop() == 0, s.stderr()[-3000:]
    assert " trace " in s.stderr()  # --log-level trace is a working level
