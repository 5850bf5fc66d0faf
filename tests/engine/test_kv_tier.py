"""The disk KV tier inside the worker: saves after the forward, loads before it, validation of the
step fields (400 naming the field, nothing changed), a failed load reported and recomputed, and
greedy tokens equal mlx-lm's whether the prefix came from the store or was computed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sidecar.engine import kv_tier
from sidecar.errors import ProtocolError
from sidecar.scheduler import Request, Scheduler, run
from tests.conftest import mlx_lm_greedy

BS = 16


@pytest.fixture
def store_dir(tmp_path: Path) -> str:
    yield str(tmp_path / "kv")
    for d in list(kv_tier._STORES):  # each test its own store; close it so its writer stops
        kv_tier._STORES.pop(d).close()


def generate(worker, prompts: list[list[int]], n: int) -> tuple[dict[str, list[int]], Scheduler]:
    sched = Scheduler(num_blocks=worker.runner.num_blocks, block_size=BS, max_num_batched_tokens=64,
                      kv_store_lookup=lambda hs: worker.kv_store_lookup(hs))
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}-{random.random()}", p, {"temperature": 0.0}, max_tokens=n, ignore_eos=True))
    done = run(sched, lambda out: worker.execute_model(out).to_wire())
    worker.runner.kv_tier.store.flush(30)
    return {r.req_id.split("-")[0]: r.output_token_ids for r in done.values()}, sched


def test_store_serves_a_new_worker_and_a_corrupt_entry_is_recomputed(make_worker, oracle_model, store_dir):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 200) for _ in range(100)]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 6)
    w1 = make_worker(num_blocks=64, kv_store_dir=store_dir)
    got, s1 = generate(w1, [prompt], 6)
    assert got["r0"] == want and s1.store.hit_blocks == 0
    saved = w1.runner.kv_tier.counters.saved_blocks
    assert saved == (100 + 5) // BS  # every full block of prompt + outputs
    # A fresh worker (fresh pool, nothing in memory) with the same store: the prefix loads.
    w2 = make_worker(num_blocks=64, kv_store_dir=store_dir)
    got, s2 = generate(w2, [prompt], 6)
    assert got["r0"] == want and s2.store.hit_blocks == (100 - 1) // BS
    assert w2.runner.kv_tier.counters.loaded_blocks == (100 - 1) // BS
    # Corrupt one stored block (the third): that load fails, is reported, and recomputed exactly.
    tier = w2.runner.kv_tier
    from sidecar.scheduler.kv_store import full_block_hashes

    hashes = full_block_hashes(Request("x", prompt, {}, 1), 6, BS)
    path, off, size = tier.store.locate(tier.key(hashes[2], ""))
    assert tier.store.locate(tier.key(hashes[3], ""))[0] == path  # a segment the prefill step wrote, shared
    raw = bytearray(path.read_bytes())
    raw[off + size - 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    w3 = make_worker(num_blocks=64, kv_store_dir=store_dir)
    got, s3 = generate(w3, [prompt], 6)
    assert got["r0"] == want
    assert w3.runner.kv_tier.counters.failed_loads == 4 and w3.runner.kv_tier.store.stats.corrupt == 1


def test_step_fields_are_validated_and_nothing_changes(make_worker, store_dir):
    w = make_worker(num_blocks=16, kv_store_dir=store_dir)
    prompt = list(range(1, 40))
    base = {"scheduled_new_reqs": [{"req_id": "a", "prompt_token_ids": prompt, "sampling_params": {"temperature": 0},
                                    "block_ids": [[0, 1, 2]], "num_computed_tokens": 16}],
            "num_scheduled_tokens": {"a": 23}, "total_num_scheduled_tokens": 23}

    def expect(extra: dict, field: str) -> None:
        with pytest.raises(ProtocolError) as e:
            w.execute_model({**base, **extra})
        assert e.value.field == field, e.value
        assert not w.runner.requests  # nothing registered

    h = b"\x01" * 32
    expect({"kv_store_load": {"a": {"block_hashes": [h], "block_ids": [1]}}}, "kv_store_load.a.block_ids[0]")  # not before pos 16
    expect({"kv_store_load": {"a": {"block_hashes": [h], "block_ids": [0]}}}, "kv_store_load.a.block_hashes[0]")  # unknown
    expect({"kv_store_load": {"b": {"block_hashes": [h], "block_ids": [0]}}}, "kv_store_load.b")  # not scheduled
    expect({"kv_store_save": {"a": {"block_hashes": [h], "block_ids": [2]}}}, "kv_store_save.a.block_ids[0]")  # not full
    expect({"kv_store_save": {"a": {"block_hashes": [h, h], "block_ids": [0]}}}, "kv_store_save.a.block_ids")
    expect({"kv_store_save": {"a": {"block_hashes": ["zz"], "block_ids": [0]}}}, "kv_store_save.a.block_hashes[0]")
    with pytest.raises(ProtocolError) as e:
        w.kv_store_lookup([b""])
    assert e.value.field == "block_hashes[0]"
    assert w.kv_store_lookup([h]) == 0
    # Valid: a save of the two blocks full after the step.
    out = w.execute_model({**base, "scheduled_new_reqs": [{**base["scheduled_new_reqs"][0], "num_computed_tokens": 0}],
                           "num_scheduled_tokens": {"a": 39}, "total_num_scheduled_tokens": 39,
                           "kv_store_save": {"a": {"block_hashes": [h, b"\x02"], "block_ids": [0, 1]}}})
    assert out.sampled_token_ids[0] and out.invalid_block_ids is None
    w.runner.kv_tier.store.flush(30)
    assert w.kv_store_lookup([h, b"\x02", b"\x03"]) == 2 and w.kv_store_lookup([h.hex()]) == 1


def test_without_a_store_the_fields_are_refused(make_worker):
    w = make_worker(num_blocks=8)
    with pytest.raises(ProtocolError) as e:
        w.execute_model({"scheduled_new_reqs": [{"req_id": "a", "prompt_token_ids": [1, 2], "block_ids": [[0]]}],
                         "num_scheduled_tokens": {"a": 2}, "total_num_scheduled_tokens": 2,
                         "kv_store_save": {"a": {"block_hashes": [b"x"], "block_ids": [0]}}})
    assert e.value.field == "kv_store_save"
    with pytest.raises(ProtocolError) as e:
        w.kv_store_lookup([b"x"])
    assert e.value.field == "kv_store"


def test_recurrent_models_refuse_the_tier_by_name(make_worker, store_dir):
    w = make_worker("builtin:tiny-mamba2", num_blocks=8, kv_store_dir=store_dir)
    with pytest.raises(ProtocolError, match="recurrent"):
        w.kv_store_lookup([b"x"])
