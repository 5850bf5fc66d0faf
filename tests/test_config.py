from __future__ import annotations

import pytest

from sidecar.config import Config, ConfigError, from_env


def test_replace_validates_keys_types_and_ranges() -> None:
    cfg = Config().replace(block_size=32, gpu_memory_utilization=1)
    assert cfg.block_size == 32 and cfg.gpu_memory_utilization == 1.0
    for bad, key in [({"nope": 1}, "nope"), ({"block_size": "16"}, "block_size"), ({"block_size": True}, "block_size"),
                     ({"block_size": 0}, "block_size"), ({"kv_dtype": "int8"}, "kv_dtype"),
                     ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")]:
        with pytest.raises(ConfigError) as e:
            Config().replace(**bad)
        assert e.value.key == key


def test_environment_overrides(monkeypatch) -> None:
    monkeypatch.setenv("MLX_SIDECAR_PORT", "9001")
    monkeypatch.setenv("MLX_SIDECAR_PRELOAD", "true")
    monkeypatch.setenv("MLX_SIDECAR_AUTH_TOKEN", "s3cret")
    cfg = from_env()
    assert (cfg.port, cfg.preload, cfg.token()) == (9001, True, "s3cret")
    assert "s3cret" not in repr(cfg)
    monkeypatch.setenv("MLX_SIDECAR_PORT", "eighty")
    with pytest.raises(ConfigError) as e:
        from_env()
    assert e.value.key == "port"


def test_token_file_wins(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert Config(auth_token="env", auth_token_file=str(f)).token() == "from-file"


def test_scale_out_settings_validate() -> None:
    assert Config().world_size == 1 and Config(tensor_parallel=2).world_size == 2
    cfg = Config().replace(pipeline_parallel=2, exit_on_rank_failure=False, rank_timeout=5)
    assert (cfg.world_size, cfg.exit_on_rank_failure, cfg.rank_timeout) == (2, False, 5.0)
    for bad, key in [({"tensor_parallel": 0}, "tensor_parallel"), ({"tensor_parallel": 2, "pipeline_parallel": 2}, "pipeline_parallel"),
                     ({"distributed_backend": "tcp"}, "distributed_backend"), ({"rank_timeout": 0}, "rank_timeout"),
                     ({"heartbeat_interval": -1.0}, "heartbeat_interval"),
                     ({"tensor_parallel": 2, "speculative_method": "ngram"}, "speculative_method")]:
        with pytest.raises(ConfigError) as e:
            Config().replace(**bad)
        assert e.value.key == key
def test_init_device_overrides_are_an_allow_list() -> None:
    from sidecar.config import RUNTIME_OVERRIDES

    base = Config()
    assert base.override({"block_size": 32, "max_model_len": None, "model": "builtin:tiny-qwen3"}).block_size == 32
    assert base.override({"max_model_len": None}).max_model_len == base.max_model_len  # null keeps the setting
    for key, value in [("lora_dir", "/"), ("model", "/models/x"), ("home", "/"), ("auth_token_file", "/t"),
                       ("uds", "/s"), ("max_body_bytes", 1), ("max_live_requests", 1), ("host", "0.0.0.0")]:
        with pytest.raises(ConfigError) as e:
            base.override({key: value})
        assert e.value.key == key and "cannot be set by init_device" in str(e.value)
    assert not RUNTIME_OVERRIDES & {"lora_dir", "home", "auth_token", "auth_token_file", "uds", "max_body_bytes",
                                    "host", "port", "allow_insecure", "protect_metrics", "max_req_id_len"}
    with pytest.raises(ConfigError, match="must be integer, got float 2.0"):
        base.override({"block_size": 2.0})


def test_init_device_may_set_the_ngram_proposer_but_not_a_draft_model_path() -> None:
    # vLLM's speculative_config reaches the sidecar this way (sidecar/vllm/convert.py)
    cfg = Config().override({"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 3})
    assert (cfg.spec_method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 1, 3)
    assert cfg.override({"speculative_method": "none"}).spec_method == "none"
    with pytest.raises(ConfigError) as e:
        Config().override({"draft_model": "builtin:tiny"})
    assert e.value.key == "draft_model" and "cannot be set by init_device" in str(e.value)
    with pytest.raises(ConfigError) as e:  # draft_model needs the operator's --draft-model
        Config().override({"speculative_method": "draft_model"})
    assert e.value.key == "draft_model"
    assert Config(draft_model="builtin:tiny").override({"speculative_method": "draft_model"}).spec_method == "draft_model"


@pytest.mark.parametrize("key, ok, bad", [("prompt_lookup_max", 128, 129), ("max_model_len", 1 << 20, (1 << 20) + 1),
                                          ("max_num_batched_tokens", 1 << 20, (1 << 20) + 1)])
def test_overrides_whose_cost_grows_with_them_are_bounded(key: str, ok: int, bad: int) -> None:
    """A scheduler's init_device may set these; each step's cost grows with them (the n-gram
    lookup ~ history x prompt_lookup_max; a step's tokens ~ max(max_num_batched_tokens, max_model_len))."""
    extra = {"speculative_method": "ngram"} if key == "prompt_lookup_max" else {}
    assert getattr(Config().override({**extra, key: ok}), key) == ok
    with pytest.raises(ConfigError) as e:
        Config().override({**extra, key: bad})
    assert e.value.key == key


@pytest.mark.parametrize("bad", [float("nan"), -2.0, 101.0])
def test_a_given_verify_cost_is_a_finite_bounded_number(bad: float) -> None:
    Config(speculative_verify_cost=0.25).validate()
    with pytest.raises(ConfigError) as e:
        Config(speculative_verify_cost=bad).validate()
    assert e.value.key == "speculative_verify_cost"
