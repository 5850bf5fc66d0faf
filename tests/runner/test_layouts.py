"""The decode fast path builds what BatchLayout.build builds, and reuses a gather plan only
while the block tables it read are unchanged."""

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
    assert a.uniform == b.uniform
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


def test_gather_plan_is_reused_only_while_tables_are_unchanged() -> None:
    b = LayoutBuilder()
    tables = [[3, 9], [5, 1]]
    first = b.build([4, 5], [1, 1], tables, BS, SINK)
    second = b.build([5, 6], [1, 1], [list(t) for t in tables], BS, SINK)  # next step, same tables
    assert second.reads is first.reads
    # Negative control: a changed table (a resumed request's new blocks) gets a fresh plan.
    third = b.build([5, 6], [1, 1], [[3, 9], [5, 2]], BS, SINK)
    assert third.reads is not first.reads
    same(third, BatchLayout.build([5, 6], [1, 1], [[3, 9], [5, 2]], BS, SINK))


def test_prefill_takes_the_general_path() -> None:
    got = LayoutBuilder().build([0], [5], [[2, 3]], BS, SINK)
    same(got, BatchLayout.build([0], [5], [[2, 3]], BS, SINK))
