"""get_kv_cache_spec tells what each layer really caches, measured from the model."""

from __future__ import annotations

import json
import math

import pytest

from sidecar.config import Config
from sidecar.errors import ProtocolError
from sidecar.worker.mlx_worker import MLXWorker
from tests.engine.test_architectures import BLOCK, served, tiny_dir


def test_window_chunk_mla_and_state_specs(home: str) -> None:
    g3 = served(home, "gemma3_text").get_kv_cache_spec()  # pattern 3: two sliding layers, then a global one
    assert [g3[f"model.layers.{i}.self_attn"]["type"] for i in range(3)] == ["sliding_window"] * 2 + ["full_attention"]
    assert g3["model.layers.0.self_attn"]["sliding_window"] == 8 and g3["model.layers.2.self_attn"]["sliding_window"] is None
    c2 = served(home, "cohere2").get_kv_cache_spec()
    assert [s["type"] for s in c2.values()] == ["sliding_window", "sliding_window", "full_attention"]

    l4 = served(home, "llama4").get_kv_cache_spec()
    assert [s["type"] for s in l4.values()] == ["chunked_local_attention"] * 3 + ["full_attention"]
    assert l4["model.layers.0.self_attn"]["attention_chunk_size"] == 8

    v3 = served(home, "deepseek_v3").get_kv_cache_spec()["model.layers.0.self_attn"]
    # MLA latent: one head of kv_lora_rank + qk_rope_head_dim (vLLM's MLAAttentionSpec)
    assert (v3["type"], v3["num_kv_heads"], v3["head_size"], v3["kv_lora_rank"], v3["qk_rope_head_dim"]) == \
        ("mla_attention", 1, 40, 32, 8)
    assert v3["page_size_bytes"] == BLOCK * 40 * 4
    for fam in ("deepseek_v2", "minicpm3"):  # K head = qk_nope + qk_rope, V head = v_head_dim (or nope)
        s = served(home, fam).get_kv_cache_spec()["model.layers.0.self_attn"]
        assert s["type"] == "full_attention" and s["head_size"] == 24 and s["head_size_v"] != 24
        assert s["page_size_bytes"] == BLOCK * s["num_kv_heads"] * (s["head_size"] + s["head_size_v"]) * 4

    w = served(home, "granitemoehybrid")  # mamba, attention, mamba
    spec = w.get_kv_cache_spec()
    assert list(spec) == ["model.layers.0.mixer", "model.layers.1.self_attn", "model.layers.2.mixer"]
    m = spec["model.layers.0.mixer"]
    assert m["type"] == "mamba" and m["prefix_caching"] is False and len(m["shapes"]) == 2
    assert m["page_size_bytes"] == sum(math.prod(s) * 4 for s in m["shapes"])
    assert w.get_cache_block_size_bytes() == sum(s["page_size_bytes"] for s in spec.values())
    groups = w.get_kv_cache_groups()
    assert [g["layer_names"] for g in groups] == [["model.layers.0.mixer", "model.layers.2.mixer"],
                                                   ["model.layers.1.self_attn"]]


def test_hf_config_names_and_bad_model_paths_are_4xx(home: str, tmp_path) -> None:
    gpt2 = served(home, "gpt2").get_kv_cache_spec()  # n_head / n_embd: read from the model, not the config
    assert gpt2["model.layers.0.self_attn"]["num_kv_heads"] == 4 and gpt2["model.layers.0.self_attn"]["head_size"] == 16

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    olmo = tmp_path / "olmo"  # mlx-lm's olmo module calls sys.exit without its optional dependency
    olmo.mkdir()
    (olmo / "config.json").write_text(json.dumps({"model_type": "olmo"}))
    for model, field in (("/nonexistent/model", "config.model"), (str(bad), "config.model"), (str(olmo), "model")):
        w = MLXWorker(Config(model=model, home=home))
        w.init_device()
        with pytest.raises(ProtocolError) as e:
            w.load_model()
        assert e.value.status == 400 and e.value.field == field  # olmo: refused naming ai2-olmo
        assert w.state.value == "device_ready"
    assert tiny_dir(home, "llama").is_dir()
