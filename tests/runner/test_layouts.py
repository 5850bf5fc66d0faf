"""The decode fast path builds what BatchLayout.build builds, reading one run in place."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from sidecar.runner.kv_cache import BatchLayout
from sidecar.runner.layouts import LayoutBuilder

BS, NUM_BLOCKS = 4, 64
SINK = NUM_BLOCKS * BS


def same(a: BatchLayout, b: BatchLayout) -> None:
    for name in ("offsets", "write_slots", "query_pos", "ctx_lens"):
        np.testing.assert_array_equal(np.array(getattr(a, name)), np.array(getattr(b, name)), err_msg=name)
    assert (a.uniform, a.scalar_offset, a.start_position, a.write_start) == (b.uniform, b.scalar_offset, b.start_position,
                                                                        b.write_start)
    assert (a.key_pos is None, a.valid_q is None) == (b.key_pos is None, b.valid_q is None)
    assert (a.reads.length, a.reads.start) == (b.reads.length, b.reads.start)
    assert (a.reads.slots is None) == (b.reads.slots is None)
    if a.reads.slots is not None:
        np.testing.assert_array_equal(np.array(a.reads.slots), np.array(b.reads.slots))
    ma, mb = a.mask(), b.mask()
    assert type(ma) is type(mb)
    if isinstance(ma, mx.array):
        np.testing.assert_array_equal(np.array(ma), np.array(mb))


def random_decode(rng: random.Random, rows: int) -> tuple[list[int], list[list[int]]]:
    free = list(range(NUM_BLOCKS))
    starts, tables = [], []
    for _ in range(rows):
        start = rng.randrange(0, 6 * BS)
        n = start // BS + 1 + rng.randrange(0, 2)  # sometimes a spare block at the end
        if rng.random() < 0.5:  # a run
            i = rng.randrange(0, len(free) - n)
            t = free[i : i + n]
        else:
            t = rng.sample(free, n)
        free = [b for b in free if b not in t]
        starts.append(start)
        tables.append(t)
    return starts, tables


@pytest.mark.parametrize("seed", range(40))
def test_decode_fast_path_equals_general_build(seed: int) -> None:
    rng = random.Random(seed)
    starts, tables = random_decode(rng, rng.choice([1, 1, 2, 3, 5]))
    if seed % 7 == 0:
        starts = [starts[0]] * len(starts)  # every row the same context: the uniform read
        tables = [t + list(range(60, 60 + starts[0] // BS + 1 - len(t))) if len(t) * BS <= starts[0] else t
                  for t in tables]
    want = BatchLayout.build(starts, [1] * len(starts), tables, BS, SINK)
    got = LayoutBuilder().build(starts, [1] * len(starts), tables, BS, SINK)
    same(got, want)


def test_one_run_is_in_place_and_a_broken_run_is_not() -> None:
    b = LayoutBuilder()
    assert b.build([9], [1], [[4, 5, 6]], BS, SINK).reads.start == 4 * BS
    assert b.build([9], [1], [[4, 6, 7]], BS, SINK).reads.slots is not None  # negative control


@pytest.mark.parametrize("kw", [{"window": 3}, {"chunk": 8}, {"scalar": True}])
def test_window_chunk_and_scalar_layouts_take_the_general_path(kw: dict) -> None:
    args = ([9], [1], [[4, 5, 6]], BS, SINK)
    same(LayoutBuilder().build(*args, **kw), BatchLayout.build(*args, **kw))


def test_prefill_takes_the_general_path() -> None:
    got = LayoutBuilder().build([0], [5], [[2, 3]], BS, SINK)
    same(got, BatchLayout.build([0], [5], [[2, 3]], BS, SINK))


def test_a_window_reads_its_visible_run_in_place() -> None:
    lay = BatchLayout.build([9], [1], [[4, 5, 6]], BS, SINK, window=3)  # reads from the block of key 7: 4..9
    assert lay.reads.start == 5 * BS and lay.reads.length == 6
    assert not BatchLayout.build([9], [1], [[4, 5, 8]], BS, SINK, window=3).reads.in_place
