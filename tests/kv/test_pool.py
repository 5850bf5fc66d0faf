"""BatchLayout: which slots a step reads per layer kind, and the masks it hands the model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from sidecar.kv.pool import BatchLayout

BS, SINK = 4, 999


def test_window_and_chunk_layouts_read_only_blocks_a_query_can_see() -> None:
    tables = [list(range(10, 20)), list(range(30, 40))]
    # row 0 decodes position 20, row 1 prefills 9..14; window 8
    lay = BatchLayout.build([20, 9], [1, 6], tables, BS, SINK, window=8)
    read = np.array(lay.read_slots)
    blocks = {int(s) // BS for s in read[0] if s != SINK}
    assert blocks == {13, 14, 15}  # positions 12..20: blocks 3..5 of row 0's table, never 0..2
    assert {int(s) // BS for s in read[1] if s != SINK} == {30, 31, 32, 33}  # positions 2..14: blocks 0..3
    m = np.array(lay.mask(8))
    assert m.shape == (2, 1, 6, read.shape[1])
    kpos = np.array(lay.key_pos)
    q = 20
    assert ((kpos[0] > q - 8) & (kpos[0] <= q) == m[0, 0, 0]).all()  # exactly the last 8 positions
    assert m.any(axis=-1).all()  # padding queries see a key too: no all-masked row
    assert lay.mask(8, five_d=True).shape == (2, 1, 1, 6, read.shape[1])

    chunked = BatchLayout.build([13], [2], [list(range(10))], BS, SINK, chunk=8)
    assert int(np.array(chunked.key_pos)[0, 0]) == 8  # the chunk of positions 8..15 starts at block 2
    cm = np.array(chunked.mask(chunk=8))[0, 0]
    assert cm.sum(axis=-1).tolist() == [6, 7]  # 13 sees 8..13, 14 sees 8..14


def test_full_attention_masks_honour_return_array() -> None:
    lay = BatchLayout.build([0, 0], [5, 5], [[1, 2], [3, 4]], BS, SINK)
    assert lay.uniform and lay.mask() == "causal"
    arr = lay.mask(return_array=True)
    assert isinstance(arr, mx.array) and arr.dtype == mx.bool_ and arr.shape == (2, 1, 5, 5)
    assert np.array_equal(np.array(arr[0, 0]), np.tril(np.ones((5, 5), bool)))
    assert BatchLayout.build([5], [1], [[1, 2]], BS, SINK).mask(return_array=True) is None  # one query: no mask


def test_one_run_is_read_in_place_and_a_broken_run_is_gathered() -> None:
    assert BatchLayout.build([9], [1], [[4, 5, 6]], BS, SINK).reads.start == 4 * BS
    assert BatchLayout.build([9], [1], [[4, 6, 7]], BS, SINK).reads.slots is not None  # negative control
    two = BatchLayout.build([9, 9], [1, 1], [[4, 5, 6], [7, 8, 9]], BS, SINK)
    assert not two.reads.in_place and two.uniform and two.mask() is None  # same context: SDPA's unmasked path


def test_a_window_reads_its_visible_run_in_place() -> None:
    lay = BatchLayout.build([9], [1], [[4, 5, 6]], BS, SINK, window=3)  # reads from the block of key 7: 4..9
    assert lay.reads.start == 5 * BS and lay.reads.length == 6
    assert not BatchLayout.build([9], [1], [[4, 5, 8]], BS, SINK, window=3).reads.in_place
