"""The strict body codecs (sidecar/codec.py) on their own: what is rejected, with which field,
and the negative controls that must pass."""

from __future__ import annotations

import functools
import json

import msgpack
import pytest

from sidecar import codec
from sidecar.codec import MAX_DEPTH, MAX_MAPS, decode_body, wire_type
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


# --- the fast path for small canonical msgpack bodies (codec._canonical) -------------------------

STEP = {"scheduler_output": {
    "scheduled_new_reqs": [], "scheduled_cached_reqs": {"req_ids": ["r-0"], "resumed_req_ids": [], "new_token_ids": [[]],
                                                        "new_block_ids": [None, [[1, 2]]], "num_computed_tokens": [70]},
    "num_scheduled_tokens": {"r-0": 1}, "total_num_scheduled_tokens": 1, "finished_req_ids": [],
    "scheduled_spec_decode_tokens": {}, "temperature": 0.5, "flag": True, "blob": b"\x00", "long": list(range(40))},
    "step_id": 5}


def outcome(body: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(codec, "FAST_MAX_BYTES", -1)
        try:
            return "ok", decode_body(body, MP)
        except ProtocolError as e:
            return "error", e.message, e.field


def test_a_canonical_step_takes_the_fast_path_and_decodes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    body = msgpack.packb(STEP, use_bin_type=True)
    assert codec._canonical(body) == STEP
    assert outcome(body, True, monkeypatch) == outcome(body, False, monkeypatch) == ("ok", STEP)


def _wide_int_body() -> bytes:
    # {"a": 1} with 1 as a uint32 (0xce): valid msgpack, not what msgpack-python writes
    return b"\x81\xa1a\xce\x00\x00\x00\x01"


@pytest.mark.parametrize("body", [
    b"\x82\xa1a\x01\xa1a\x02",  # a repeated key
    b"\x81\xa1x\x82\x01\x01\x01\x02",  # a repeated int key
    msgpack.packb({"sp": {"logit_bias": {3: 1.0}}}),  # int keys where they are allowed
    msgpack.packb({"sp": {"other": {3: 1.0}}}),  # and where they are not
    b"\x81\xc4\x01a\x01",  # a binary key
    msgpack.packb({"t": [1, msgpack.Timestamp(0)]}),  # the timestamp ext
    b"\x81\xa1t\xd4\x05\x00",  # another ext type
    _wide_int_body(),  # a non-canonical encoding (taken by the full decode, as before)
    b"\x81\xa1f\xca\x3f\x80\x00\x00",  # a float32
    msgpack.packb([1, 2]),  # not a map
    msgpack.packb(None),
    msgpack.packb({"a": "\u00e9"})[:-1],  # cut short
    b"\x81\xa1a\xa2\xff\xfe",  # invalid UTF-8
    msgpack.packb(functools.reduce(lambda acc, _: [acc], range(MAX_DEPTH + 2), 1)),  # too deep
    msgpack.packb({"m": [{}] * (MAX_MAPS + 1)}),  # too many maps
])
def test_other_bodies_get_the_full_decodes_answer(body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    assert codec._canonical(body) is None
    assert outcome(body, True, monkeypatch) == outcome(body, False, monkeypatch)


def test_a_large_body_is_left_to_the_full_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    body = msgpack.packb({"ids": list(range(1000, 1000 + codec.FAST_MAX_BYTES // 3))})
    assert len(body) > codec.FAST_MAX_BYTES
    calls = []
    monkeypatch.setattr(codec, "_canonical", lambda b: calls.append(b) or None)
    assert decode_body(body, MP)["ids"][-1] == 999 + codec.FAST_MAX_BYTES // 3
    assert calls == []  # negative control below: a small body does reach it
    decode_body(msgpack.packb({"a": 1}), MP)
    assert len(calls) == 1


def test_json_integers_stay_in_msgpacks_range() -> None:
    """msgpack carries [-2**63, 2**64); a JSON body may not smuggle a wider int to a handler (a
    float() of it would overflow), and the message names where it is."""
    edge = decode_body(b'{"a": [18446744073709551615, -9223372036854775808]}', JS)
    assert edge == {"a": [2**64 - 1, -(2**63)]}
    for text, path in ((b'{"a": {"t": [1, 18446744073709551616]}}', "a.t[1]"), (b'{"b": -9223372036854775809}', "b"),
                       (b'{"scheduler_output": {"x": {"temperature": 1%s}}}' % (b"0" * 400), "x.temperature")):
        e = reject(text, JS)
        assert e.field == path and "64-bit range" in e.message, (e.field, e.message)
