"""The load-time batching probe and the exact (unpadded) batches of models that need them."""

from __future__ import annotations

from sidecar.runner.batch_caches import exact_batches
from sidecar.runner.kv_spec import ModelCaches
from sidecar.runner.requests import RequestState, Row
from sidecar.runner.sampler import SamplingParams
from tests.runner.test_architectures import served


def test_probe_finds_models_that_cannot_take_padded_batches(home: str) -> None:
    # gpt_bigcode builds positions with numpy from the offset (an error with per-row offsets);
    # afm7's KV-reuse layers take positions from the number of keys read (silently wrong).
    for family, one_row in (("llama", False), ("gemma3_text", False), ("gpt_bigcode", True), ("afm7", True)):
        w = served(home, family)
        assert w.runner.caches.scalar_offsets is one_row, family
        assert w.runner.decode_ahead is (not one_row and w.config.decode_ahead)


def test_exact_batches_group_equal_lengths_and_fresh_rows_apart() -> None:
    p = SamplingParams(temperature=0.0)
    rows = [Row(RequestState(str(i), [1] * 9, p, [i]), start, [1] * n, [i], True)
            for i, (start, n) in enumerate([(0, 4), (4, 4), (0, 4), (8, 1), (3, 1), (0, 2)])]
    caches = ModelCaches([], [])
    assert exact_batches(rows, list(range(6)), caches) == [[0, 2], [1], [3, 4], [5]]
    caches.scalar_offsets = True
    assert exact_batches(rows, [0, 1, 2], caches) == [[0], [1], [2]]
