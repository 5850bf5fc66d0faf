"""Pool pages <-> store payloads: exact round trips for every pool leaf layout, and the namespace."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.kv import transfer
from sidecar.kv.pool import KVPool
from sidecar.kv.spec import STATE, LayerSpec


def _fill(pool: KVPool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for leaf in pool.keys + pool.values:
        for a in (leaf if isinstance(leaf, list) else [leaf]):
            if a is None:
                continue
            bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.size]
            x = mx.array(rng.integers(0, 2 ** (8 * a.dtype.size) - 1, a.shape, dtype=np.uint64).astype(bits))
            a[...] = x.view(a.dtype) if a.dtype.size != 4 or a.dtype != mx.uint32 else x


@pytest.mark.parametrize("dtype,bits", [("float32", None), ("bfloat16", None), ("float16", 8), ("float32", 4)])
def test_round_trip_between_pools(dtype: str, bits: int | None):
    specs = [LayerSpec(4, 2, 64, 64, dtype, kv_bits=bits, name=f"l{i}") for i in range(2)]
    src, dst = KVPool(specs, 6), KVPool(specs, 6)
    _fill(src, 0)
    _fill(dst, 1)
    payloads = transfer.read_blocks(src, [4, 1])
    assert all(len(p) == transfer.entry_bytes(src) for p in payloads)
    assert transfer.entry_bytes(src) == sum(s.page_size_bytes for s in specs)  # exactly the pages
    transfer.write_blocks(dst, [0, 5], payloads)
    for a, b in zip(transfer._leaves(src), transfer._leaves(dst)):
        A, B = np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8))
        assert np.array_equal(A[:, :, 16:20], B[:, :, 0:4]) and np.array_equal(A[:, :, 4:8], B[:, :, 20:24])
        assert not np.array_equal(A[:, :, 8:12], B[:, :, 8:12])  # other blocks untouched (negative control)


def test_namespace_covers_the_settings_and_recurrent_layers_are_refused():
    a = LayerSpec(16, 2, 64, 64, "float16", name="l0")
    ns = {transfer.namespace("m", [a]), transfer.namespace("m2", [a]),
          transfer.namespace("m", [LayerSpec(32, 2, 64, 64, "float16")]),
          transfer.namespace("m", [LayerSpec(16, 2, 64, 64, "float16", kv_bits=8)]),
          transfer.namespace("m", [LayerSpec(16, 2, 64, 64, "bfloat16")])}
    assert len(ns) == 5
    assert transfer.refusal([a]) is None
    state = LayerSpec(16, 0, 0, 0, "float32", kind=STATE, state_shapes=((4,),), state_dtypes=("float32",), name="m.1")
    assert "m.1" in transfer.refusal([a, state])


def test_loads_read_into_staging_are_used_where_they_lie(tmp_path):
    """The store reads a step's payloads back to back into one device buffer (`staging`): the pool
    load views them there (no copy); payloads from separate buffers are copied once; both load
    exactly."""
    from sidecar.kv.store import BlockStore, entry_key

    specs = [LayerSpec(4, 2, 64, 64, "bfloat16", name=f"l{i}") for i in range(2)]
    src = KVPool(specs, 6)
    _fill(src, 0)
    payloads = transfer.read_blocks(src, [4, 1, 2])
    size = transfer.entry_bytes(src)
    store = BlockStore(tmp_path, 1 << 30)
    keys = [entry_key(b"ns", bytes([i])) for i in range(3)]
    store.put_many(list(zip(keys, payloads)))
    store.flush(10)
    got = store.get_many(keys, out=transfer.staging(3 * size))
    store.close()

    def address(a: mx.array) -> int:
        mx.eval(a)
        return np.asarray(memoryview(a)).ctypes.data

    assert isinstance(memoryview(got[0]).obj, mx.array)
    rows = transfer._as_rows(got, size)
    assert rows.shape == (3, size) and address(rows) == np.frombuffer(got[0], np.uint8).ctypes.data
    separate = [bytes(p) for p in payloads]
    assert address(transfer._as_rows(separate, size)) != np.frombuffer(separate[0], np.uint8).ctypes.data
    for data in (got, separate):
        dst = KVPool(specs, 6)
        _fill(dst, 1)
        transfer.write_blocks(dst, [0, 3, 5], data)
        for a, b in zip(transfer._leaves(src), transfer._leaves(dst)):
            A, B = np.array(a.view(mx.uint8)), np.array(b.view(mx.uint8))
            assert np.array_equal(A[:, :, 16:20], B[:, :, 0:4]) and np.array_equal(A[:, :, 4:8], B[:, :, 12:16])
            assert np.array_equal(A[:, :, 8:12], B[:, :, 20:24])
