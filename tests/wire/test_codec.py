"""The strict body codecs (sidecar/wire/codec.py) on their own: what is rejected, with which field,
and the negative controls that must pass."""

from __future__ import annotations

import json

import msgpack
import pytest

from sidecar.wire.codec import MAX_DEPTH, MAX_MAPS, decode_body, wire_type
from sidecar.errors import ProtocolError

MP, JS = "application/msgpack", "application/json"


def reject(body: bytes, ctype: str = MP) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        decode_body(body, ctype)
    return e.value


@pytest.mark.parametrize("body", [b"\x81\x91\x01\x01", bytes.fromhex("8181a1610101"), b"\x81\xc0\x01", b"\x81\xc3\x01",
                                  b"\x81\xca\x00\x00\x00\x00\x01", b"\x81\xc4\x01a\x01", b"\x82\xa1a\x01\xc0\x02"])
def test_non_string_keys(body: bytes) -> None:
    assert "map keys must be strings" in reject(body).message


def test_int_keys_only_in_int_keyed_maps() -> None:
    assert decode_body(msgpack.packb({"sp": {"logit_bias": {3: 1.0}}}), MP) == {"sp": {"logit_bias": {3: 1.0}}}
    e = reject(msgpack.packb({"sp": {"other": {3: 1.0}}}))
    assert e.field == "sp.other" and "got integer 3" in e.message
    assert reject(msgpack.packb({"scheduler_output": {"num_scheduled_tokens": {1: 1}}})).field == "num_scheduled_tokens"


def test_duplicates_ext_types_and_surrogates() -> None:
    assert "duplicate map key 'a'" in reject(b"\x82\xa1a\x01\xa1a\x02").message
    assert "duplicate map key 1" in reject(b"\x81\xa1x\x82\x01\x01\x01\x02").message
    assert "duplicate map key 'a'" in reject(b'{"a": 1, "a": 2}', JS).message
    e = reject(msgpack.packb({"t": [1, msgpack.Timestamp(0)]}))
    assert e.field == "t[1]" and "timestamp" in e.message
    assert "ext type 5" in reject(msgpack.packb({"t": msgpack.ExtType(5, b"")})).message
    e = reject(b'{"x": {"y": ["ok", "\\udfff"]}}', JS)
    assert e.field == "x.y[1]" and "surrogate" in e.message
    assert reject(b'{"\\ud800": 1}', JS).field is None
    assert decode_body(json.dumps({"x": "\U0001f600"}).encode(), JS) == {"x": "\U0001f600"}  # an escaped pair is fine
    assert decode_body(b'{"x": "\\\\ud800"}', JS) == {"x": "\\ud800"}  # an escaped backslash, not a surrogate
    assert "malformed JSON" in reject(b'{"x": "\xed\xa0\x80"}', JS).message


def test_depth_and_map_count() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert "nesting deeper" in reject(msgpack.packb({"x": deep})).message
    assert "nesting deeper" in reject(json.dumps({"x": deep}).encode(), JS).message
    ok: object = [[1, 2], [3]]
    for _ in range(MAX_DEPTH - 4):
        ok = [ok]
    assert decode_body(msgpack.packb({"x": ok}), MP)
    assert "at most" in reject(msgpack.packb({"x": [{}] * (MAX_MAPS + 1)})).message
    assert len(decode_body(msgpack.packb({"x": [{}] * (MAX_MAPS - 1)}), MP)["x"]) == MAX_MAPS - 1


def test_wire_type_names() -> None:
    assert [wire_type(v) for v in (None, True, 1, 2.0**53, "s", b"b", [], {})] == [
        "null", "boolean", "integer", "float 9007199254740992.0", "string", "binary", "array", "map"]


@pytest.mark.parametrize("body, value", [
    (b"\x81\xa1a\xce\x00\x00\x00\x01", {"a": 1}),  # a uint32 where msgpack-python writes a fixint
    (b"\x81\xa1f\xca\x3f\x80\x00\x00", {"f": 1.0}),  # a float32
    (b"\x81\xd9\x01a\xc4\x01\x00", {"a": b"\x00"}),  # a str8 key, binary value
])
def test_other_encoders_encodings_decode(body: bytes, value: dict) -> None:
    assert decode_body(body, MP) == value


def test_json_integers_stay_in_msgpacks_range() -> None:
    """msgpack carries [-2**63, 2**64); a JSON body may not smuggle a wider int to a handler (a
    float() of it would overflow), and the message names where it is."""
    edge = decode_body(b'{"a": [18446744073709551615, -9223372036854775808]}', JS)
    assert edge == {"a": [2**64 - 1, -(2**63)]}
    for text, path in ((b'{"a": {"t": [1, 18446744073709551616]}}', "a.t[1]"), (b'{"b": -9223372036854775809}', "b"),
                       (b'{"scheduler_output": {"x": {"temperature": 1%s}}}' % (b"0" * 400), "x.temperature")):
        e = reject(text, JS)
        assert e.field == path and "64-bit range" in e.message, (e.field, e.message)
