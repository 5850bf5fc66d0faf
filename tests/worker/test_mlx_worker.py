from __future__ import annotations

import gc
import json

import mlx.core as mx
import pytest

from sidecar.config import Config
from sidecar.errors import ProtocolError, StateError
from sidecar.worker.mlx_worker import MLXWorker, State, device_memory_bytes


def test_lifecycle_order_is_enforced(home: str) -> None:
    w = MLXWorker(Config(home=home, max_num_batched_tokens=64, max_num_seqs=4))  # a quick warm-up
    with pytest.raises(StateError, match="call init_device first"):
        w.load_model()
    w.init_device()
    with pytest.raises(StateError, match="call load_model first"):
        w.get_kv_cache_spec()
    w.load_model()
    with pytest.raises(StateError, match="call initialize_cache first"):
        w.execute_model({})
    with pytest.raises(StateError, match="call initialize_cache first"):
        w.compile_or_warm_up_model()
    w.initialize_cache(8)
    assert w.state == State.CACHE_READY
    assert w.compile_or_warm_up_model() > 0
    assert w.state == State.READY
    assert "state=ready" in repr(w) and "num_blocks=8" in repr(w)


def test_spec_and_block_bytes_are_exact(make_worker) -> None:
    w = make_worker("builtin:tiny-qwen3")
    spec = w.get_kv_cache_spec()
    s = spec["model.layers.0.self_attn"]
    assert s == {"type": "full_attention", "block_size": 16, "num_kv_heads": 2, "head_size": 16, "head_size_v": 16,
                 "dtype": "float32", "sliding_window": None, "page_size_bytes": 16 * 2 * 32 * 4}
    assert w.get_cache_block_size_bytes() == 2 * s["page_size_bytes"]
    # The pool really is that big (plus a scratch slot and a padding slot per layer).
    pool = w.runner.pool
    slot_bytes = 2 * 16 * 4 * 2 * len(spec)
    assert pool.nbytes == w.runner.num_blocks * w.get_cache_block_size_bytes() + 2 * slot_bytes


def test_kv_dtype_override(make_worker) -> None:
    w = make_worker(kv_dtype="float16")
    assert w.get_kv_cache_spec()["model.layers.0.self_attn"]["dtype"] == "float16"
    assert w.runner.pool.keys[0].dtype == mx.float16


def test_available_memory_accounts_for_weights_and_activations(make_worker) -> None:
    w = make_worker(max_num_batched_tokens=64, max_num_seqs=4)  # a quick profile run
    free = w.determine_available_memory()
    total = device_memory_bytes() * w.config.gpu_memory_utilization
    assert 0 < free < total - w.weights_bytes
    assert w.activation_peak_bytes > 0


def test_warm_up_after_the_memory_profile_runs_nothing_again(home: str, monkeypatch) -> None:
    import sidecar.worker.mlx_worker as mw

    runs: list[tuple[int, int]] = []
    real = mw.profile_run
    monkeypatch.setattr(mw, "profile_run", lambda r, c: runs.append((c.max_num_batched_tokens, c.max_num_seqs)) or real(r, c))
    w = MLXWorker(Config(home=home, max_num_batched_tokens=64, max_num_seqs=4))
    w.init_device()
    w.load_model()
    w.determine_available_memory()
    w.initialize_cache(8)
    assert w.compile_or_warm_up_model() == 0.0 and w.state == State.READY
    assert runs == [(64, 4)]  # measured once: the warm-up had run at that shape
    w.init_device(config={"max_num_batched_tokens": 32}, reset=True)  # another shape: warmed up again
    w.load_model()
    w.initialize_cache(8)
    assert w.compile_or_warm_up_model() > 0
    assert runs == [(64, 4), (32, 4)]


def test_initialize_from_config(make_worker) -> None:
    w = make_worker()
    names = list(w.get_kv_cache_spec())
    spec = w.get_kv_cache_spec()[names[0]]
    w.initialize_from_config({"num_blocks": 12, "kv_cache_tensors": [],
                              "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": spec}]})
    assert w.runner.num_blocks == 12
    with pytest.raises(ProtocolError) as e:
        w.initialize_from_config({"num_blocks": 12, "kv_cache_groups": [{"layer_names": ["nope"]}]})
    assert e.value.field == "kv_cache_config.kv_cache_groups[0].layer_names[0]"
    with pytest.raises(ProtocolError) as e:
        w.initialize_from_config({"num_blocks": 12, "kv_cache_groups": [{"layer_names": names[:1]}]})
    assert e.value.field == "kv_cache_config.kv_cache_groups"
    bad = {"layer_names": names, "kv_cache_spec": {**spec, "block_size": 2 * spec["block_size"]}}
    with pytest.raises(ProtocolError) as e:
        w.initialize_from_config({"num_blocks": 12, "kv_cache_groups": [bad]})
    assert e.value.field == "kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size"
    with pytest.raises(ProtocolError) as e:
        w.initialize_from_config({"num_blocks": 12, "kv_cache_groups": [{"layer_names": [7]}]})
    assert e.value.field == "kv_cache_config.kv_cache_groups[0].layer_names[0]"
    for n in (0, 2**63):  # initialize_cache's own checks, named as this call's field
        with pytest.raises(ProtocolError) as e:
            w.initialize_from_config({"num_blocks": n})
        assert e.value.field == "kv_cache_config.num_blocks", e.value.message
    assert w.runner.num_blocks == 12


def test_init_device_overrides_are_validated(home: str) -> None:
    w = MLXWorker(Config(home=home))
    with pytest.raises(ProtocolError) as e:
        w.init_device(config={"block_size": "big"})
    assert e.value.field == "config.block_size"
    with pytest.raises(ProtocolError) as e:
        w.init_device(config={"nonsense": 1})
    assert e.value.field == "config.nonsense"
    assert w.state == State.CREATED
    w.init_device(config={"block_size": 32})
    assert w.config.block_size == 32


def test_check_health(make_worker) -> None:
    w = make_worker()
    w.check_health()
    assert w.healthy and w.last_health_check > 0


def test_shutdown_returns_memory_to_baseline(home: str) -> None:
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    w = MLXWorker(Config(model="builtin:small", home=home))
    w.init_device()
    w.load_model()
    w.initialize_cache(256)
    loaded = mx.get_active_memory()
    assert loaded - baseline > 100e6  # the weights really were resident
    w.shutdown()
    gc.collect()
    after = mx.get_active_memory()
    assert after - baseline < 0.1 * (loaded - baseline), (baseline, loaded, after)
    assert w.state == State.SHUT_DOWN


def _greedy(w: MLXWorker, rid: str) -> list[int]:
    from tests.driver import Driver

    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add(rid, list(range(3, 30)))
    out = d.run(6)[rid]
    d.finish(rid)
    d.step()
    return out


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_up_restores(make_worker, level: int) -> None:
    from sidecar.errors import Unavailable

    w = make_worker(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=4)
    w.compile_or_warm_up_model()
    want = _greedy(w, "before")
    gc.collect()
    awake, cache, weights = mx.get_active_memory(), 512 * w.get_cache_block_size_bytes(), w.weights_bytes
    assert weights > 0
    w.sleep(level)
    gc.collect()
    freed = awake - mx.get_active_memory()
    if level == 1:
        assert cache <= freed < cache + weights  # the cache went, the weights stayed
    else:
        assert freed >= cache + weights  # the weights went too
    with pytest.raises(Unavailable, match="sleeping"):
        w.execute_model({})
    if level == 2:
        w.wake_up(tags=["weights"])
        assert w.state == State.SLEEPING  # the cache is still asleep
        w.wake_up(tags=["kv_cache"])
    else:
        w.wake_up()
    assert w.state == State.READY and w.runner.num_blocks == 512
    assert _greedy(w, "after") == want


def test_sleep_level_is_validated(make_worker) -> None:
    w = make_worker()
    with pytest.raises(ProtocolError) as e:
        w.sleep(3)
    assert e.value.field == "level"
    assert w.state == State.CACHE_READY


def test_profile_writes_a_real_profile(make_worker) -> None:
    import pstats

    w = make_worker()
    with pytest.raises(StateError):
        w.profile(is_start=False)
    w.profile(is_start=True)
    _greedy(w, "p")
    path = w.profile(is_start=False)
    names = {fn for (_, _, fn) in pstats.Stats(path).stats}  # type: ignore[attr-defined]
    assert "execute_model" in names and "forward" in names


def test_oversized_initialize_cache_is_a_400_and_changes_nothing(make_worker) -> None:
    from sidecar.worker.memory import memory_budget_bytes

    w = make_worker()
    pool, per_block = w.runner.pool, w.get_cache_block_size_bytes()
    too_many = memory_budget_bytes() // per_block + 1  # under the machine's total memory, over what it can give
    with pytest.raises(ProtocolError) as e:
        w.initialize_cache(too_many)
    assert e.value.field == "num_gpu_blocks" and f"{too_many} blocks need" in str(e.value)
    assert w.runner.pool is pool and w.runner.num_blocks == 256 and w.state == State.CACHE_READY
    w.initialize_cache(300)  # negative control: a pool that fits is allocated
    assert w.runner.num_blocks == 300


def test_initialize_cache_budget_counts_the_pool_it_replaces(make_worker, monkeypatch, tmp_path) -> None:
    from sidecar.worker import memory

    w = make_worker()
    pool = w.runner.pool
    nothing_free = tmp_path / "meminfo"
    nothing_free.write_text("MemAvailable: 0 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", nothing_free)
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    mx.clear_cache()  # (MLX's buffer cache is the process's to reuse, so it counts as room)
    with pytest.raises(ProtocolError) as e:  # the old check (the machine's total) let this through
        w.initialize_cache(256 + (64 << 20) // w.get_cache_block_size_bytes())
    assert e.value.field == "num_gpu_blocks" and w.runner.pool is pool
    w.initialize_cache(256)  # the same size again fits in the memory the old pool gives back
    assert w.runner.num_blocks == 256 and w.state == State.CACHE_READY


def test_init_device_sets_and_unsets_the_ngram_proposer(home: str) -> None:
    # what the vLLM worker class sends for vLLM's speculative_config (sidecar/vllm/convert.py)
    from sidecar.engine.proposers import NgramProposer

    w = MLXWorker(Config(home=home, speculative_method="ngram", num_speculative_tokens=5))
    w.init_device(config={"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3})
    w.load_model()
    p = w.runner.proposer
    assert isinstance(p, NgramProposer) and (p.k, p.n_min, p.n_max) == (2, 1, 3)
    with pytest.raises(ProtocolError) as e:  # a draft model is the operator's: nothing changes
        w.init_device(config={"speculative_method": "draft_model"}, reset=True)
    assert e.value.field == "config.draft_model" and w.runner.proposer is p
    w.init_device(config={"speculative_method": "none"}, reset=True)
    w.load_model()
    assert w.runner.proposer is None


def _vision_checkpoint(home: str, dest, family: str, weights: bool) -> str:
    """builtin:tiny's llama as the text half of a `family` checkpoint (mlx-lm's layout for it:
    text_config, weights under language_model.), with a vision_config."""
    import shutil

    from sidecar.models import resolve_model

    src = resolve_model("builtin:tiny", home)
    dest.mkdir()
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dest / f.name)
    text = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({"model_type": family, "text_config": text,
                                                  "vision_config": {"hidden_size": 32}}))
    if weights:
        mx.save_safetensors(str(dest / "model.safetensors"), {
            f"language_model.{k}": v for k, v in mx.load(str(src / "model.safetensors")).items()})
    return str(dest)


def test_a_vision_family_without_served_images_serves_its_text_half_or_is_refused_by_name(home, tmp_path) -> None:
    """pixtral (mlx-lm has its text half): loads, an image is refused naming the family. llava
    (mlx-lm has not): refused at load_model naming the family and the served ones."""
    import numpy as np

    from sidecar.wire.multimodal import encode_tensor

    w = MLXWorker(Config(model=_vision_checkpoint(home, tmp_path / "pixtral", "pixtral", True), home=home))
    w.init_device()
    w.load_model()
    w.initialize_cache(16, 0)
    item = {"modality": "image", "identifier": "x", "mm_hash": "x", "mm_position": {"offset": 1, "length": 2},
            "data": {"pixel_values": encode_tensor(np.zeros((1, 3, 4, 4), np.float32))}}
    with pytest.raises(ProtocolError) as e:
        w.execute_model({"scheduled_new_reqs": [{"req_id": "r", "prompt_token_ids": [1, 2, 3, 4],
                                                 "sampling_params": {"temperature": 0.0}, "block_ids": [[0]],
                                                 "num_computed_tokens": 0, "mm_features": [item]}],
                         "num_scheduled_tokens": {"r": 4}, "total_num_scheduled_tokens": 4})
    assert e.value.field == "scheduled_new_reqs[0].mm_features" and "pixtral" in str(e.value)
    w = MLXWorker(Config(model=_vision_checkpoint(home, tmp_path / "llava", "llava", False), home=home))
    w.init_device()
    with pytest.raises(ProtocolError) as e:
        w.load_model()
    assert e.value.field == "config.model" and "llava is a vision-language family" in str(e.value)
    assert "qwen2_5_vl" in str(e.value) and w.model is None
