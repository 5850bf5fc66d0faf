from __future__ import annotations

import json

import msgpack
import pytest

from sidecar.errors import ProtocolError
from sidecar.protocol import MAX_DEPTH, SchedulerOutput, decode_body, encode_body


def so(**over: object) -> dict:
    d = {
        "scheduled_new_reqs": [{"req_id": "a", "prompt_token_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0},
                                "block_ids": [[0]], "num_computed_tokens": 0, "lora_request": None}],
        "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [],
                                  "num_computed_tokens": [], "num_output_tokens": []},
        "num_scheduled_tokens": {"a": 3}, "total_num_scheduled_tokens": 3,
        "finished_req_ids": [], "preempted_req_ids": None,
        "scheduled_spec_decode_tokens": {}, "num_common_prefix_blocks": [0],
    }
    d.update(over)
    return d


def decode(d: dict) -> SchedulerOutput:
    return SchedulerOutput.from_wire(d, vocab_size=100, max_logprobs=5)


def test_valid_output_decodes() -> None:
    out = decode(so())
    assert out.scheduled_new_reqs[0].prompt_token_ids == [1, 2, 3]
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.preempted_req_ids == []


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["scheduled_new_reqs"][0].update(prompt_token_ids="abc"), "scheduled_new_reqs[0].prompt_token_ids"),
    (lambda d: d["scheduled_new_reqs"][0].update(prompt_token_ids=[1, "x"]), "scheduled_new_reqs[0].prompt_token_ids[1]"),
    (lambda d: d["scheduled_new_reqs"][0].update(block_ids=[[0, True]]), "scheduled_new_reqs[0].block_ids[0][1]"),
    (lambda d: d["scheduled_new_reqs"][0].pop("req_id"), "scheduled_new_reqs[0].req_id"),
    (lambda d: d["scheduled_new_reqs"][0].update(sampling_params={"temperature": -1}), "scheduled_new_reqs[0].sampling_params.temperature"),
    (lambda d: d.update(total_num_scheduled_tokens="3"), "total_num_scheduled_tokens"),
    (lambda d: d.update(num_scheduled_tokens={"a": 1.5}), "num_scheduled_tokens.a"),
    (lambda d: d["scheduled_cached_reqs"].update(req_ids=["x"]), "scheduled_cached_reqs.new_block_ids"),  # v2: an empty new_token_ids is fine
])
def test_type_errors_name_the_field(mutate, field: str) -> None:
    d = so()
    mutate(d)
    with pytest.raises(ProtocolError) as e:
        decode(d)
    assert e.value.field == field


def test_older_resumed_flags_are_accepted() -> None:
    d = so(scheduled_cached_reqs={"req_ids": ["x"], "resumed_from_preemption": [True], "new_token_ids": [[]],
                                  "new_block_ids": [[[1]]], "num_computed_tokens": [0]})
    assert decode(d).scheduled_cached_reqs.resumed_req_ids == {"x"}


def test_msgpack_and_json_bodies() -> None:
    body = msgpack.packb({"scheduler_output": so()})
    assert decode_body(body, "application/msgpack")["scheduler_output"]["num_scheduled_tokens"] == {"a": 3}
    assert decode_body(json.dumps({"x": 1}).encode(), "application/json") == {"x": 1}
    assert decode_body(b"", "application/msgpack") == {}
    assert msgpack.unpackb(encode_body({"result": [1.5]}, True)) == {"result": [1.5]}


@pytest.mark.parametrize("body, ctype, needle", [
    (b"\xc1\x00", "application/msgpack", "malformed msgpack"),
    (b"{not json", "application/json", "malformed JSON"),
    (msgpack.packb([1, 2]), "application/msgpack", "map of keyword arguments"),
    (msgpack.packb({"a": msgpack.ExtType(1, b"x")}), "application/msgpack", "ext type"),
    (msgpack.packb({b"k": 1}, use_bin_type=True), "application/msgpack", "map keys must be strings"),
    (msgpack.packb({"a": [1.0] * 3, 1.5: 2}), "application/msgpack", "map keys must be strings"),
])
def test_bad_bodies(body: bytes, ctype: str, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode_body(body, ctype)


def test_depth_limit() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nesting deeper"):
        decode_body(msgpack.packb({"x": deep}), "application/msgpack")
    shallow: object = 1
    for _ in range(MAX_DEPTH - 3):
        shallow = [shallow]
    assert decode_body(msgpack.packb({"x": shallow}), "application/msgpack")  # the negative control
