"""Multimodal items on the wire: typed binary arrays, placeholders, encoder instructions (no MLX)."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.errors import ProtocolError
from sidecar.wire import multimodal as mm
from sidecar.wire.protocol import SchedulerOutput


def item(**over) -> dict:
    d = {"modality": "image", "identifier": "h", "mm_position": {"offset": 2, "length": 4, "is_embed": None},
         "data": {"pixel_values": mm.encode_tensor(np.arange(12, dtype=np.float32).reshape(3, 4))}}
    d.update(over)
    return d


def test_a_tensor_round_trips_exactly():
    for a in [np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([1, 6, 8], np.int64),
              np.ones((2, 0, 3), np.float16), np.array(3, np.int32)]:
        b = mm.tensor(mm.encode_tensor(a), "t")
        assert b.dtype == a.dtype and b.shape == a.shape and (b == a).all()


@pytest.mark.parametrize("change, field", [
    ({"dtype": "complex64"}, "t.dtype"),
    ({"dtype": {"a": 1}}, "t.dtype"),  # (not a name: no lookup may fail on it)
    ({"dtype": ["float32"]}, "t.dtype"),
    ({"shape": [3, -4]}, "t.shape[1]"),
    ({"shape": [1 << 28, 1 << 28, 1 << 8], "data": b""}, "t.shape"),  # 2^64 elements: wraps to 0 in int64
    ({"shape": [1 << 100, 0], "data": b""}, "t.shape[0]"),  # zero elements, but no such dimension
    ({"shape": [3, 5]}, "t.data"),  # 60 bytes wanted, 48 sent
    ({"shape": [1 << 20, 1 << 20]}, "t.shape"),  # over the bound: refused before any allocation
    ({"data": "not bytes"}, "t.data"),
    ({"data": np.array([np.nan] * 12, np.float32).tobytes()}, "t.data"),
])
def test_bad_tensors_name_the_field(change, field):
    d = {**mm.encode_tensor(np.zeros((3, 4), np.float32)), **change}
    with pytest.raises(ProtocolError) as e:
        mm.tensor(d, "t")
    assert e.value.field == field


@pytest.mark.parametrize("over, field", [
    ({"modality": "audio"}, "f[0].modality"),
    ({"identifier": ""}, "f[0].identifier"),
    ({"mm_position": {"offset": 8, "length": 4}}, "f[0].mm_position"),  # past the 10-token prompt
    ({"mm_position": {"offset": 2, "length": 0}}, "f[0].mm_position"),
    ({"mm_position": {"offset": 2, "length": 2, "is_embed": [True]}}, "f[0].mm_position.is_embed"),
    ({"mm_position": {"offset": 2, "length": 2, "is_embed": [False, False]}}, "f[0].mm_position.is_embed"),
    ({"data": {"pixel_values": {"dtype": "float32", "shape": [1], "data": b""}}}, "f[0].data.pixel_values.data"),
])
def test_bad_items_name_the_field(over, field):
    with pytest.raises(ProtocolError) as e:
        mm.features([item(**over)], "f", prompt_len=10)
    assert e.value.field == field


def test_items_in_order_and_not_overlapping():
    a, b = item(), item(identifier="g", mm_position={"offset": 4, "length": 2})
    with pytest.raises(ProtocolError) as e:
        mm.features([a, b], "f", prompt_len=10)
    assert e.value.field == "f[1].mm_position"
    b["mm_position"]["offset"] = 6
    got = mm.features([a, b], "f", prompt_len=10)
    assert [f.identifier for f in got] == ["h", "g"] and got[1].mm_position.num_embeds == 2


def test_the_scheduler_output_carries_items_and_instructions():
    d = {"scheduled_new_reqs": [{"req_id": "r", "prompt_token_ids": list(range(10)), "block_ids": [[0]],
                                 "mm_features": [item()]}],
         "num_scheduled_tokens": {"r": 10}, "total_num_scheduled_tokens": 10,
         "scheduled_encoder_inputs": {"r": [0]}, "free_encoder_mm_hashes": ["old"]}
    out = SchedulerOutput.from_wire(d, vocab_size=100, max_logprobs=5)
    assert out.scheduled_new_reqs[0].mm_features[0].data["pixel_values"].shape == (3, 4)
    assert out.encoder.scheduled_encoder_inputs == {"r": [0]} and out.encoder.free_encoder_mm_hashes == ["old"]
    plain = SchedulerOutput.from_wire({"num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0},
                                      vocab_size=100, max_logprobs=5)
    assert plain.encoder == mm.EncoderInstructions()  # a v2 step: no images, nothing to encode
    for bad, field in [({"scheduled_encoder_inputs": {"r": ["0"]}}, "scheduled_encoder_inputs.r[0]"),
                       ({"free_encoder_mm_hashes": [3]}, "free_encoder_mm_hashes[0]")]:
        with pytest.raises(ProtocolError) as e:
            SchedulerOutput.from_wire({**d, **bad}, vocab_size=100, max_logprobs=5)
        assert e.value.field == field
