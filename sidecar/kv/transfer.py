"""Pool pages <-> store entries: a block's bytes as the pool holds them, and the store namespace.

An entry's payload is, for every K and V leaf of the pool in order (a quantised leaf: its packed
data, scales and biases), the leaf's `[1, H, block_size, D]` slice for the block, head-major as
the pool lays it out. Saving gathers all of a step's blocks on the device and copies them to the
host at once; loading has the store read a step's blocks into one device buffer (`staging`) and
scatters them from there with one update per leaf. Recurrent state is not
kept: its value at a block boundary is not in the pool (one state slot per request), so models
with recurrent layers are refused by name (`refusal`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from sidecar.kv.pool import KVPool
from sidecar.kv.spec import STATE, LayerSpec

FORMAT = 1


def refusal(specs: Sequence[LayerSpec]) -> str | None:
    """Why this model's blocks cannot be stored, or None."""
    for i, s in enumerate(specs):
        if s.kind == STATE:
            return (f"layer {s.name or i} keeps recurrent state (mamba), which no block holds: "
                    "the KV store is not offered for models with recurrent layers")
    return None


def model_identity(path: Path | None) -> str:
    """The model's config plus, per weight file, its name, size and a hash of its first and last MiB
    (cheap at start-up; two checkpoints differing only in the middle of a file are not told apart)."""
    if path is None:
        return ""
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def namespace(model: str, specs: Sequence[LayerSpec]) -> bytes:
    """What a block's bytes depend on besides its tokens: the model, the KV dtype/quantisation, the
    block size and every layer's page layout."""
    desc = {"format": FORMAT, "model": model,
            "layers": [[s.kind, s.block_size, s.num_kv_heads, s.head_size, s.head_size_v, s.dtype, s.kv_bits,
                        s.sliding_window, s.attention_chunk_size] for s in specs]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()


def _leaves(pool: KVPool) -> list[mx.array]:
    """Every K and V array of the pool, in a fixed order (quantised leaves: three arrays)."""
    out: list[mx.array] = []
    for leaf in pool.keys + pool.values:
        if leaf is not None:
            out.extend(leaf if isinstance(leaf, list) else [leaf])
    return out


def _slots(block_ids: Sequence[int], bs: int) -> mx.array:
    return mx.array((np.asarray(block_ids, np.int64)[:, None] * bs + np.arange(bs)).reshape(-1).astype(np.int32))


def entry_bytes(pool: KVPool) -> int:
    return sum(a.shape[1] * pool.block_size * a.shape[3] * a.dtype.size for a in _leaves(pool))


def read_blocks(pool: KVPool, block_ids: Sequence[int]) -> list[memoryview]:
    """Each block's payload: rows of one host array, filled by one device-to-host copy."""
    if not block_ids:
        return []
    n, bs, idx = len(block_ids), pool.block_size, _slots(block_ids, pool.block_size)
    parts = [a[:, :, idx].reshape(a.shape[1], n, bs, a.shape[3]).transpose(1, 0, 2, 3).reshape(n, -1).view(mx.uint8)
             for a in _leaves(pool)]
    rows = np.array(mx.concatenate(parts, axis=1))
    return [memoryview(r) for r in rows]


def staging(nbytes: int) -> memoryview:
    """Device memory for the store to read a step's loads into (unified memory on Apple silicon,
    host memory on the CPU): the pool load then uses the bytes where the read left them."""
    buf = mx.zeros((nbytes,), mx.uint8)
    mx.eval(buf)
    return memoryview(buf)


def _as_rows(payloads: Sequence[bytes | memoryview], size: int) -> mx.array:
    """The payloads as one (n, size) byte array on the device: a view when they lie back to back
    in one device buffer (`staging`, as the store fills it), else one copy."""
    views = [np.frombuffer(p, np.uint8) for p in payloads]
    owner = memoryview(payloads[0]).obj
    if owner is not None and all(len(v) == size for v in views):
        whole = np.frombuffer(owner, np.uint8)
        at = views[0].ctypes.data - whole.ctypes.data
        n = len(views)
        if 0 <= at <= whole.nbytes - n * size and all(
                v.ctypes.data == views[0].ctypes.data + j * size for j, v in enumerate(views)):
            if isinstance(owner, mx.array):
                return owner[at:at + n * size].reshape(n, size)
            return mx.array(whole[at:at + n * size].reshape(n, size))
    return mx.array(np.stack(views))


def write_blocks(pool: KVPool, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
    """Scatter payloads (from read_blocks, verified by the store) into these blocks, every leaf:
    at most one copy of all of them to the device (none from `staging`), then one update per leaf."""
    if not block_ids:
        return
    n, bs, idx = len(block_ids), pool.block_size, _slots(block_ids, pool.block_size)
    rows = _as_rows(payloads, entry_bytes(pool))
    off = 0
    for a in _leaves(pool):
        H, D = a.shape[1], a.shape[3]
        size = H * bs * D * a.dtype.size
        x = rows[:, off:off + size].view(a.dtype).reshape(n, H, bs, D).transpose(1, 0, 2, 3)
        a[:, :, idx] = x.reshape(1, H, n * bs, D)
        off += size
