"""Wire types of the disk KV tier (docs/protocol.md, "Disk KV tier"): decoding only, no MLX.

A step may carry `kv_store_load` and `kv_store_save`, each `{req_id: {block_hashes, block_ids}}`
(pairs, in order): load the stored block of hash i into block id i before the forward / store
block id i under hash i after it. A hash is msgpack bin or a hex string (JSON), 1..64 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.errors import ProtocolError
from sidecar.wire.codec import wire_type

MAX_HASH_BYTES = 64
MAX_BLOCKS = 65536  # per request and list, checked before the list is walked
LOAD, SAVE = "kv_store_load", "kv_store_save"


@dataclass
class BlockTransfer:
    """One request's blocks to load or save: block_hashes[i] <-> block_ids[i]."""

    block_hashes: list[bytes]
    block_ids: list[int]


def block_hash(v: Any, path: str) -> bytes:
    if isinstance(v, str):
        try:
            v = bytes.fromhex(v)
        except ValueError:
            raise ProtocolError("a block hash is bytes, or a hex string in JSON", field=path) from None
    elif not isinstance(v, bytes):
        raise ProtocolError(f"expected binary|string, got {wire_type(v)}", field=path)
    if not 1 <= len(v) <= MAX_HASH_BYTES:
        raise ProtocolError(f"a block hash has 1..{MAX_HASH_BYTES} bytes, got {len(v)}", field=path)
    return v


def block_hashes(v: Any, path: str) -> list[bytes]:
    if not isinstance(v, list):
        raise ProtocolError(f"expected array, got {wire_type(v)}", field=path)
    if len(v) > MAX_BLOCKS:
        raise ProtocolError(f"at most {MAX_BLOCKS} block hashes", field=path)
    return [block_hash(h, f"{path}[{i}]") for i, h in enumerate(v)]


def transfers(d: dict, key: str) -> dict[str, BlockTransfer]:
    """Decode scheduler_output[key] (absent or null: nothing)."""
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ProtocolError(f"expected map, got {wire_type(v)}", field=key)
    out: dict[str, BlockTransfer] = {}
    for rid, t in v.items():
        path = f"{key}.{rid}"
        if not isinstance(t, dict):
            raise ProtocolError(f"expected map, got {wire_type(t)}", field=path)
        hashes = block_hashes(t.get("block_hashes"), f"{path}.block_hashes")
        ids = t.get("block_ids")
        if not isinstance(ids, list) or any(type(b) is not int for b in ids):
            raise ProtocolError("expected array of integers", field=f"{path}.block_ids")
        if len(ids) != len(hashes):
            raise ProtocolError(f"{len(ids)} block_ids for {len(hashes)} block_hashes", field=f"{path}.block_ids")
        out[rid] = BlockTransfer(hashes, ids)
    return out
