"""Decoding the disk KV tier's step fields: types, lengths and hash forms, with field paths."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.kv_store import MAX_BLOCKS, transfers


def test_decodes_bin_and_hex_hashes():
    got = transfers({"kv_store_load": {"r": {"block_hashes": [b"\x01\x02", "0a0b"], "block_ids": [3, 4]}}},
                    "kv_store_load")
    assert got["r"].block_hashes == [b"\x01\x02", b"\x0a\x0b"] and got["r"].block_ids == [3, 4]
    assert transfers({}, "kv_store_save") == {} and transfers({"kv_store_save": None}, "kv_store_save") == {}


@pytest.mark.parametrize("value,field", [
    ([], "kv_store_save"),
    ({"r": []}, "kv_store_save.r"),
    ({"r": {"block_hashes": "x", "block_ids": []}}, "kv_store_save.r.block_hashes"),
    ({"r": {"block_hashes": [1], "block_ids": [0]}}, "kv_store_save.r.block_hashes[0]"),
    ({"r": {"block_hashes": [b""], "block_ids": [0]}}, "kv_store_save.r.block_hashes[0]"),
    ({"r": {"block_hashes": [b"x" * 65], "block_ids": [0]}}, "kv_store_save.r.block_hashes[0]"),
    ({"r": {"block_hashes": ["xyz"], "block_ids": [0]}}, "kv_store_save.r.block_hashes[0]"),
    ({"r": {"block_hashes": [b"x"], "block_ids": [True]}}, "kv_store_save.r.block_ids"),
    ({"r": {"block_hashes": [b"x"], "block_ids": []}}, "kv_store_save.r.block_ids"),
    ({"r": {"block_hashes": [b"x"] * (MAX_BLOCKS + 1), "block_ids": []}}, "kv_store_save.r.block_hashes"),
])
def test_bad_fields_are_named(value, field):
    with pytest.raises(ProtocolError) as e:
        transfers({"kv_store_save": value}, "kv_store_save")
    assert e.value.field == field
