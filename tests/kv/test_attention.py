"""The paged cache's write and read paths: in place for one row whose blocks are a run, a gather otherwise;
both read exactly the row's slots, and a stream decodes mlx-lm's tokens on either path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.kv import attention
from sidecar.kv.pool import BatchLayout
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.test_model_runner import prompts

BS = 4


def naive(pool: np.ndarray, table: list[int], length: int) -> np.ndarray:
    """[H, length, D]: the row's slots, one by one (pool [1, H, S, D])."""
    slots = [table[p // BS] * BS + p % BS for p in range(length)]
    return pool[0][:, slots]


def plan(tables: list[list[int]], ctx: list[int], length: int, sink: int = 64 * BS) -> attention.SlotPlan:
    """The plan for rows reading `length` keys (past a row's context: the padding slot), whose
    gather slots are the ones worked out slot by slot here."""
    p = attention.plan_reads(tables, [0] * len(tables), ctx, length, BS, sink)
    if p.slots is not None:
        want = [[t[i // BS] * BS + i % BS if i < n else sink for i in range(length)] for t, n in zip(tables, ctx)]
        np.testing.assert_array_equal(np.array(p.slots), want)
    return p


@pytest.mark.parametrize("lo", [[0, 0], [3, 5], [4, 9]])
def test_slots_are_the_slot_by_slot_answer(lo: list[int]) -> None:
    """Per-block slots equal the per-position formula, from any first position, with each row's
    positions past its end on the padding slot; and one slot per row (a decode's write)."""
    tables, hi, width = [[9, 3, 7, 1], [2, 8, 4, 6]], [13, 14], 9
    got = attention.slots(tables, lo, [min(h, p + width) for h, p in zip(hi, lo)], width, BS, 999)
    want = [[t[q // BS] * BS + q % BS if q < min(h, p + width) else 999 for q in range(p, p + width)]
            for t, p, h in zip(tables, lo, hi)]
    np.testing.assert_array_equal(got, want)
    assert attention.slots(tables, lo, hi, 1, BS, 999).tolist() == [[t[p // BS] * BS + p % BS] for t, p in zip(tables, lo)]


def test_one_run_is_read_in_place_and_exact() -> None:
    pool = mx.random.normal((1, 2, 64 * BS + 1, 8), key=mx.random.key(0))
    p = plan([[5, 6, 7]], [10], 10)
    assert p.in_place and p.start == 5 * BS and p.slots is None
    got = attention.read(pool, p, mx.float32)
    assert got.shape == (1, 2, 10, 8)
    np.testing.assert_array_equal(np.array(got[0]), naive(np.array(pool), [5, 6, 7], 10))
    # Blocks past the context do not break the run (they are read but masked, never needed).
    assert plan([[5, 6, 30]], [8], 8).in_place
    assert plan([[9]], [3], 3).in_place


@pytest.mark.parametrize("tables,ctx,length", [
    ([[5, 7, 6]], [10], 10),  # out of order
    ([[7, 6, 5]], [12], 12),  # descending (an LRU free list hands these out)
    ([[5, 6, 9]], [10], 10),  # a run, then a jump
    ([[1, 2], [3, 4, 5]], [7, 11], 11),  # two rows, even both runs
])
def test_other_reads_are_gathered_and_exact(tables: list[list[int]], ctx: list[int], length: int) -> None:
    pool = mx.random.normal((1, 2, 64 * BS + 1, 8), key=mx.random.key(1))
    p = plan(tables, ctx, length)
    assert not p.in_place and p.slots is not None
    got = np.array(attention.read(pool, p, mx.float32))
    assert got.shape == (len(tables), 2, length, 8)
    for b, (t, n) in enumerate(zip(tables, ctx)):
        np.testing.assert_array_equal(got[b, :, :n], naive(np.array(pool), t, n))


def test_read_is_not_trivially_equal() -> None:
    """Negative control for the checks above: a neighbour's slots differ from the row's."""
    pool = np.array(mx.random.normal((1, 2, 64 * BS + 1, 8), key=mx.random.key(2)))
    assert not np.array_equal(naive(pool, [5, 6, 7], 10), naive(pool, [5, 6, 8], 10))
    assert not np.array_equal(naive(pool, [5, 6, 7], 10), naive(pool, [6, 7, 8], 10))


def test_write_then_read_round_trips() -> None:
    pool = mx.zeros((1, 2, 16 * BS + 1, 8))
    new = mx.random.normal((1, 2, 3, 8), key=mx.random.key(3))
    table = [[2, 3]]
    lay = BatchLayout.build([2], [3], table, BS, 16 * BS)  # positions 2..4: slots 10, 11, 12
    assert lay.reads.in_place and lay.reads.start == 2 * BS
    assert lay.writes.in_place and lay.writes.start == 2 * BS + 2
    pool = attention.write(pool, lay.writes, new)
    got = attention.read(pool, lay.reads, mx.float32)
    np.testing.assert_array_equal(np.array(got[0, :, 2:5]), np.array(new[0]))
    assert float(mx.abs(got[0, :, :2]).sum()) == 0.0  # nothing else written


def test_scattered_writes_land_in_each_rows_slots() -> None:
    """Rows of different lengths, scattered blocks: each row's new K/V land in its own slots, head
    by head; a shorter row's padding queries land only in the padding slot."""
    sink = 16 * BS
    pool = mx.zeros((1, 3, sink + 1, 8))
    new = mx.random.normal((2, 3, 3, 8), key=mx.random.key(4))
    tables, starts, lengths = [[5, 2], [9, 1, 7]], [2, 7], [3, 2]
    lay = BatchLayout.build(starts, lengths, tables, BS, sink)
    assert not lay.writes.in_place
    got = np.array(attention.write(pool, lay.writes, new))
    want = np.zeros_like(got)
    for b, (t, s, n) in enumerate(zip(tables, starts, lengths)):
        for i in range(n):
            p = s + i
            want[0, :, t[p // BS] * BS + p % BS] = np.array(new[b, :, i])
    np.testing.assert_array_equal(got[0, :, :sink], want[0, :, :sink])
    np.testing.assert_array_equal(got[0, :, sink], np.array(new[1, :, 2]))  # row 1's padding query


@pytest.mark.parametrize("layout", ["run", "scattered"])
def test_stream_matches_mlx_lm_on_both_paths(make_worker, oracle_model, layout: str) -> None:
    """Greedy tokens equal mlx-lm's with the row's blocks a run (read in place) or scattered
    (gathered); corrupting a block the row reads changes them (the reads are real)."""
    w = make_worker()
    bs = w.config.block_size
    prompt = prompts(w.vocab_size(), [3 * bs + 5], seed=11)[0]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 20)
    blocks = [10, 11, 12, 13, 14, 15] if layout == "run" else [40, 7, 23, 3, 31, 18]
    seen: list[bool] = []
    plan_reads = attention.plan_reads

    def spy(*args):
        reads = plan_reads(*args)
        seen.append(reads.in_place)
        return reads

    attention.plan_reads = spy
    try:
        d = Driver(w.execute_model, bs, w.runner.num_blocks)
        d.add("a", prompt, blocks=list(blocks))
        assert d.run(20, chunk=64)["a"] == want
        assert all(seen) if layout == "run" else not any(seen)

        # Negative control: noise in the row's second block changes the continuation.
        pool = w.runner.pool
        for i in range(len(pool.keys)):
            s = mx.arange(blocks[1] * bs, (blocks[1] + 1) * bs)
            pool.keys[i][:, :, s] = mx.random.normal(pool.keys[i][:, :, s].shape, key=mx.random.key(i)) * 10
        mx.eval(pool.keys)
        d.add("b", prompt, blocks=list(blocks), computed=len(prompt) - 1)  # a's K/V as a cached prefix
        assert d.run(20)["b"] != want
    finally:
        attention.plan_reads = plan_reads


@pytest.mark.parametrize("start", [3, None])
def test_zero_width_values_are_neither_written_nor_gathered(start):
    """A keys-only cache (minimax_m3's block indexer) stores values of width 0: nothing to write,
    and the read is an empty [B, H, K, 0] (MLX traps on a zero-width scatter or gather)."""
    pool = mx.zeros((1, 1, 8, 0))
    w = attention.SlotPlan(2, start, None if start is not None else mx.array([[3, 4]], dtype=mx.int32))
    assert attention.write(pool, w, mx.zeros((1, 1, 2, 0))) is pool
    p = attention.SlotPlan(5, 0, None) if start is not None else attention.SlotPlan(5, None, mx.zeros((2, 5), mx.int32))
    out = attention.read(pool, p, mx.float32)
    mx.eval(out)
    assert out.shape == ((1 if start is not None else 2), 1, 5, 0)


@pytest.mark.parametrize("tables,starts", [([[2, 3]], [2]), ([[5, 2], [9, 1]], [2, 3])])
def test_a_write_leaves_the_array_it_was_given_as_it_was(tables, starts) -> None:
    """A caller holding a step's pool arrays (to evaluate them) still holds that step's after the
    next forward is built on them: the write returns a new array, in place or scattered."""
    pool = mx.zeros((1, 2, 16 * BS + 1, 8))
    mx.eval(pool)
    held = pool
    lay = BatchLayout.build(starts, [1] * len(starts), tables, BS, 16 * BS)
    out = attention.write(pool, lay.writes, mx.ones((len(starts), 2, 1, 8)))
    assert out is not held and float(mx.abs(held).sum()) == 0.0
    assert float(out.sum()) == len(starts) * 2 * 8  # (negative control: the write did land)
