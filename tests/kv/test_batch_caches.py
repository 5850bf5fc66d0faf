"""The load-time batching probe and the exact (unpadded) batches of models that need them."""

from __future__ import annotations

import pytest

from sidecar.kv.batch_caches import read_bounded, read_limit, step_batches
from sidecar.kv.spec import STATE, LayerSpec, ModelCaches
from sidecar.engine.state import RequestState, Row
from sidecar.engine.sampler import SamplingParams
from tests.engine.test_architectures import served


def test_probe_finds_models_that_cannot_take_padded_batches(home: str) -> None:
    # gpt_bigcode builds positions with numpy from the offset (an error with per-row offsets);
    # afm7's KV-reuse layers take positions from the number of keys read (silently wrong).
    for family, one_row in (("llama", False), ("gemma3_text", False), ("gpt_bigcode", True), ("afm7", True)):
        w = served(home, family)
        assert w.runner.caches.scalar_offsets is one_row, family
        assert w.runner.decode_ahead is (not one_row and w.config.decode_ahead)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_small_blocks_load_and_serve_mlx_lm_greedy(make_worker, oracle_model, block_size: int) -> None:
    """The load-time probe gives its prompts as many blocks as they span at any block size (it
    once assumed two), and a batch over blocks of one to three tokens keeps mlx-lm's tokens."""
    from tests.conftest import mlx_lm_greedy
    from tests.driver import Driver

    w = make_worker(num_blocks=128, block_size=block_size)
    d = Driver(w.execute_model, block_size, 128)
    prompts = {"a": [5, 9, 13, 17, 21, 25, 29], "b": [40, 41, 42, 43]}
    for rid, p in prompts.items():
        d.add(rid, p)
    got = d.run(4, chunk=3)
    for rid, p in prompts.items():
        assert got[rid] == mlx_lm_greedy(oracle_model("builtin:tiny"), p, 4)[0], rid


def test_batches_of_models_that_cannot_take_padding() -> None:
    """Recurrent state: equal lengths together, fresh rows apart from continuing ones; int offsets:
    one row at a time; else the decode rows together and the prefill rows padded."""
    p = SamplingParams(temperature=0.0)
    rows = [Row(RequestState(str(i), [1] * 9, p, [i]), start, [1] * n, [i], True)
            for i, (start, n) in enumerate([(0, 4), (4, 4), (0, 4), (8, 1), (3, 1), (0, 2)])]
    decode, prefill = [3, 4], [0, 1, 2, 5]
    state = LayerSpec(16, 1, 1, 1, "float32", kind=STATE, state_shapes=((1,),), state_dtypes=("float32",))
    caches = ModelCaches([state], [])
    assert caches.has_state
    assert step_batches(rows, decode, prefill, caches) == [[3, 4], [0, 2], [1], [5]]
    caches.scalar_offsets = True
    assert step_batches(rows, [], [0, 1, 2], caches) == [[0], [1], [2]]
    padded = ModelCaches([], [])  # negative control: a model that takes padding pads
    assert step_batches(rows, decode, prefill, padded) == [[3, 4], [0, 1, 2, 5]]  # 16 slots for 14 tokens
    # a decoder exact in a batch only below position 9 (rows_apart_past): the furthest row reaches 8
    assert step_batches(rows, decode, prefill, ModelCaches([], [], rows_apart_past=9)) == [[3, 4], [0, 1, 2, 5]]
    assert step_batches(rows, decode, prefill, ModelCaches([], [], rows_apart_past=8)) == [[3], [4], [0], [1], [2], [5]]


def test_prefill_groups_bound_padding() -> None:
    import random

    rng = random.Random(8)
    p = SamplingParams(temperature=0.0)
    caches = ModelCaches([], [])
    for _ in range(200):
        lengths = [rng.choice([1, rng.randrange(2, 600)]) for _ in range(rng.randrange(1, 20))]
        rows = [Row(RequestState(str(i), [1] * n, p, [i]), 0, [1] * n, [i], True) for i, n in enumerate(lengths)]
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        groups = step_batches(rows, decode, prefill, caches)
        assert groups[0] == decode and sorted(i for g in groups[1:] for i in g) == prefill
        for g in groups[1:]:
            padded, real = len(g) * max(lengths[i] for i in g), sum(lengths[i] for i in g)
            assert len(g) == 1 or padded <= 1.25 * real
    two = [Row(RequestState(str(i), [1] * n, p, [i]), 0, [1] * n, [i], True) for i, n in enumerate([512, 20])]
    assert step_batches(two, [], [0, 1], caches) == [[], [0], [1]]  # never pad 20 tokens to 512
    two = [Row(RequestState(str(i), [1] * n, p, [i]), 0, [1] * n, [i], True) for i, n in enumerate([100, 96])]
    assert step_batches(two, [], [0, 1], caches) == [[], [0, 1]]


def test_read_bounded_splits_only_past_the_limit() -> None:
    def row(end: int) -> Row:
        s = RequestState(f"r{end}", [1] * end, SamplingParams(temperature=0.0), [0])
        return Row(s, end - 1, [1], [0], True)

    rows = [row(e) for e in (100, 10, 90, 20, 100)]
    assert read_bounded(rows, [0, 1, 2, 3, 4], 500) == [[0, 1, 2, 3, 4]]  # 5 x 100: within
    got = read_bounded(rows, [0, 1, 2, 3, 4], 200)
    assert sorted(i for b in got for i in b) == [0, 1, 2, 3, 4]  # every row once
    assert all(len(b) * max(rows[i].end for i in b) <= 200 for b in got) and len(got) > 1
    assert read_bounded(rows, [0], 50) == [[0]]  # one row alone, whatever its context
    assert read_limit(256, 2000) == 2000 and read_limit(256, 10) == 4 * 256


def test_a_fan_out_over_a_shared_prefix_is_split_and_keeps_mlx_lm_tokens(make_worker, oracle_model, monkeypatch) -> None:
    """Twelve requests on one 64-token prefix (prefix hits on the same blocks): a decode step
    would read 12 x ~70 key slots per layer, past the limit of an 8-block pool (4 x 128); it runs
    as several batches, each request's tokens still mlx-lm's own."""
    from sidecar.engine.model_runner import ModelRunner
    from tests.conftest import mlx_lm_greedy
    from tests.driver import Driver

    w = make_worker(num_blocks=32, max_model_len=128)
    monkeypatch.setattr(w.runner, "read_limit", lambda: 4 * 8 * 16)  # an 8-block pool's
    model = oracle_model("builtin:tiny")
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    prefix = [(7 * i) % 200 + 3 for i in range(64)]
    d.add("a", prefix + [5])
    d.step(chunk=80)
    w.runner.overlap.flush()  # a's decode-ahead, queued before what is counted (as a server does after its reply)
    shared = d.reqs["a"].blocks[:4]  # the prefix's four full blocks
    for k in range(12):
        d.add(f"f{k}", prefix + [9 + k], blocks=shared + d.alloc(1), computed=64)
    forwards: list[int] = []
    real = ModelRunner.forward

    def counted(self, rows, *a, **kw):  # (counts the batches; the forward itself is the real one)
        forwards.append(len(rows))
        return real(self, rows, *a, **kw)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    d.step(only=[f"f{k}" for k in range(12)])  # 12 rows of one new token each, after 64 computed
    assert len(forwards) > 1 and sum(forwards) == 12 and max(forwards) * 65 <= 4 * 8 * 16
    for k in (0, 11):
        assert d.reqs[f"f{k}"].out[0] == mlx_lm_greedy(model, prefix + [9 + k], 1)[0][0]
