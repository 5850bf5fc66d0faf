from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from sidecar.config import Config
from sidecar.errors import NotSupported, ProtocolError, StateError
from sidecar.worker import MLXWorker, State, device_memory_bytes


def test_lifecycle_order_is_enforced(home: str) -> None:
    w = MLXWorker(Config(home=home))
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
    # The pool really is that big (plus the one padding slot per layer).
    pool = w.runner.pool
    slot_bytes = 2 * 16 * 4 * 2 * len(spec)
    assert pool.nbytes == w.runner.num_blocks * w.get_cache_block_size_bytes() + slot_bytes


def test_kv_dtype_override(make_worker) -> None:
    w = make_worker(kv_dtype="float16")
    assert w.get_kv_cache_spec()["model.layers.0.self_attn"]["dtype"] == "float16"
    assert w.runner.pool.keys[0].dtype == mx.float16


def test_available_memory_accounts_for_weights_and_activations(make_worker) -> None:
    w = make_worker()
    free = w.determine_available_memory()
    total = device_memory_bytes() * w.config.gpu_memory_utilization
    assert 0 < free < total - w.weights_bytes
    assert w.activation_peak_bytes > 0


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


def test_check_health_and_unsupported_calls(make_worker) -> None:
    w = make_worker()
    w.check_health()
    assert w.healthy and w.last_health_check > 0
    with pytest.raises(NotSupported):
        w.list_loras()


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
