from __future__ import annotations

import json

import msgpack
import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.codec import MAX_DEPTH, decode_body, encode_body
from sidecar.wire.protocol import SchedulerOutput


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
    assert out.num_decode_steps == 1 and decode(so(num_decode_steps=64)).num_decode_steps == 64


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["scheduled_new_reqs"][0].update(prompt_token_ids="abc"), "scheduled_new_reqs[0].prompt_token_ids"),
    (lambda d: d["scheduled_new_reqs"][0].update(prompt_token_ids=[1, "x"]), "scheduled_new_reqs[0].prompt_token_ids[1]"),
    (lambda d: d["scheduled_new_reqs"][0].update(block_ids=[[0, True]]), "scheduled_new_reqs[0].block_ids[0][1]"),
    (lambda d: d["scheduled_new_reqs"][0].pop("req_id"), "scheduled_new_reqs[0].req_id"),
    (lambda d: d["scheduled_new_reqs"][0].update(sampling_params={"temperature": -1}), "scheduled_new_reqs[0].sampling_params.temperature"),
    (lambda d: d.update(total_num_scheduled_tokens="3"), "total_num_scheduled_tokens"),
    (lambda d: d.update(num_scheduled_tokens={"a": 1.5}), "num_scheduled_tokens.a"),
    (lambda d: d["scheduled_cached_reqs"].update(req_ids=["x"]), "scheduled_cached_reqs.new_block_ids"),  # v2: an empty new_token_ids is fine
    (lambda d: d.update(num_decode_steps=0), "num_decode_steps"),
    (lambda d: d.update(num_decode_steps=65), "num_decode_steps"),
    (lambda d: d.update(num_decode_steps=2.0), "num_decode_steps"),
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


# --- the decode step: what vLLM's scheduler sends on nearly every step -----------------------


def step(**over: object) -> dict:
    d = {
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": {"req_ids": ["a", "b"], "resumed_req_ids": [], "new_token_ids": [[], [-1]],
                                  "new_block_ids": [None, [[7]]], "num_computed_tokens": [40, 9],
                                  "num_output_tokens": [3, 1]},
        "num_scheduled_tokens": {"a": 1, "b": 1}, "total_num_scheduled_tokens": 2,
        "scheduled_spec_decode_tokens": {}, "num_common_prefix_blocks": [0],
        "finished_req_ids": ["z"], "preempted_req_ids": [],
    }
    d.update(over)
    return d


def test_a_decode_step_decodes_with_its_defaults() -> None:
    c = decode(step()).scheduled_cached_reqs
    assert (c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) == (
        ["a", "b"], [[], [-1]], [None, [[7]]], [40, 9])
    d = step()
    for k in ("scheduled_new_reqs", "scheduled_spec_decode_tokens", "finished_req_ids", "preempted_req_ids"):
        d[k] = None
    for k in ("new_token_ids", "new_block_ids", "num_computed_tokens"):
        d["scheduled_cached_reqs"].pop(k)
    out = decode(d)
    c = out.scheduled_cached_reqs
    assert (c.new_token_ids, c.new_block_ids, c.num_computed_tokens) == ([[], []], [None, None], [0, 0])
    assert (out.scheduled_new_reqs, out.finished_req_ids, out.scheduled_spec_decode_tokens) == ([], [], {})
    d["scheduled_cached_reqs"]["new_token_ids"] = []  # v2: vLLM sends [] unless pipeline-parallel
    assert decode(d).scheduled_cached_reqs.new_token_ids == [[], []]


def _cached(**over: object):
    return lambda d: d["scheduled_cached_reqs"].update(over)


@pytest.mark.parametrize("mutate, field, words", [
    (lambda d: d.update(num_scheduled_tokens={"a": True, "b": 1}), "num_scheduled_tokens.a", "got boolean"),
    (lambda d: d.update(num_scheduled_tokens={"a": 1.0, "b": 1}), "num_scheduled_tokens.a", "got float 1.0"),
    (lambda d: d.update(total_num_scheduled_tokens=None), "total_num_scheduled_tokens", "got null"),
    (lambda d: d.pop("num_scheduled_tokens"), "num_scheduled_tokens", "missing required field"),
    (_cached(req_ids=["a", 3]), "scheduled_cached_reqs.req_ids[1]", "got integer"),
    (_cached(req_ids="ab"), "scheduled_cached_reqs.req_ids", "expected array, got string"),
    (_cached(new_token_ids=[[True], []]), "scheduled_cached_reqs.new_token_ids[0][0]", "got boolean"),
    (_cached(new_token_ids=[[]]), "scheduled_cached_reqs.new_token_ids", "1 entries for 2 req_ids"),
    (_cached(new_token_ids=[1, 2]), "scheduled_cached_reqs.new_token_ids[0]", "expected array, got integer"),
    (_cached(new_block_ids=[None, [[True]]]), "scheduled_cached_reqs.new_block_ids[1][0][0]", "got boolean"),
    (_cached(new_block_ids=[None, [7]]), "scheduled_cached_reqs.new_block_ids[1][0]", "got integer"),
    (_cached(new_block_ids=[0, [[7]]]), "scheduled_cached_reqs.new_block_ids[0]", "got integer"),
    (_cached(new_block_ids=[None]), "scheduled_cached_reqs.new_block_ids", "1 entries for 2 req_ids"),
    (_cached(num_computed_tokens=[40.0, 9]), "scheduled_cached_reqs.num_computed_tokens[0]", "got float 40.0"),
    (_cached(all_token_ids={"a": [1, 2.0]}), "scheduled_cached_reqs.all_token_ids.a[1]", "got float 2.0"),
    (lambda d: d.update(finished_req_ids=[1]), "finished_req_ids[0]", "got integer"),
    (lambda d: d.update(preempted_req_ids="a"), "preempted_req_ids", "got string"),
    (lambda d: d.update(scheduled_cached_reqs=[]), "scheduled_cached_reqs", "expected map, got array"),
])
def test_decode_step_errors_name_the_field(mutate, field: str, words: str) -> None:
    d = step()
    mutate(d)
    with pytest.raises(ProtocolError) as e:
        decode(d)
    assert e.value.field == field and words in e.value.message, (e.value.field, e.value.message)
