from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models import llama
import numpy as np
import pytest

from sidecar.models import BUILTIN_MODELS, ModelNotFound, cache_home, resolve_model
from sidecar.models import builtin, store

TINY = ["tiny", "tiny-qwen3"]


def weights_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name, value in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        h.update(name.encode())
        h.update(np.array(value).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", TINY)
def test_tiny_builtin_loads_and_generates(tmp_path: Path, name: str) -> None:
    path = resolve_model(f"builtin:{name}", home=str(tmp_path))
    assert path == tmp_path / "models" / f"{name}-v2"
    assert (path / builtin.MARKER).is_file()
    model, tokenizer = mlx_lm.load(str(path))
    text = mlx_lm.generate(model, tokenizer, "The keeper climbed the steps", max_tokens=12)
    assert isinstance(text, str) and text

    config = json.loads((path / "config.json").read_text())
    spec = BUILTIN_MODELS[name]
    assert config["model_type"] == spec.model_type
    assert config["vocab_size"] == len(tokenizer._tokenizer) == 512
    eos = tokenizer.convert_tokens_to_ids("<|eos|>")
    assert config["eos_token_id"] == tokenizer.eos_token_id == eos
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.eos_token_ids == {config["eos_token_id"]}
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert tokenizer.encode("The sea")[0] == config["bos_token_id"]  # llama-style bos
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|bos|>User: Hi there\nAssistant:"

    weights = mx.load(str(path / "model.safetensors"))
    assert all(w.dtype == mx.float32 for w in weights.values())
    assert ("lm_head.weight" in weights) == (not config["tie_word_embeddings"])
    if name == "tiny-qwen3":
        assert config["tie_word_embeddings"] is True
        assert "model.layers.0.self_attn.q_norm.weight" in weights
    else:
        assert config["tie_word_embeddings"] is False
    # Random but well-behaved: finite logits with spread, so greedy picks are not near-ties.
    logits = model(mx.array([tokenizer.encode("The sea was calm")]))
    assert mx.isfinite(logits).all().item()
    assert 0.5 < logits.std(axis=-1).min().item() < 10


def test_weights_and_tokenizer_are_deterministic(tmp_path: Path) -> None:
    a = resolve_model("builtin:tiny", home=str(tmp_path / "a"))
    b = resolve_model("builtin:tiny", home=str(tmp_path / "b"))
    assert weights_digest(a) == weights_digest(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    # Negative control: the digest does see the seed.
    other = tmp_path / "other-seed"
    other.mkdir()
    builtin.write_builtin("tiny", other, seed=builtin.SEED + 1)
    assert weights_digest(other) != weights_digest(a)


def test_half_written_directory_is_replaced(tmp_path: Path) -> None:
    models = tmp_path / "models"
    stale = models / "tiny-v2"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no marker: a crashed generator's leftovers
    (models / ".tmp-tiny-crashed").mkdir()
    (models / ".tmp-tiny-qwen3-other").mkdir()  # another built-in's: not ours to judge
    path = resolve_model("builtin:tiny", home=str(tmp_path))
    assert path == stale and (path / builtin.MARKER).is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in models.glob(".tmp-*")] == [".tmp-tiny-qwen3-other"]


def test_concurrent_resolves_generate_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = builtin.write_builtin

    def counting(name: str, dest: Path, seed: int = builtin.SEED) -> None:
        calls.append(dest)
        time.sleep(0.2)  # keep the others waiting on the lock, not finding the result
        real(name, dest, seed)

    monkeypatch.setattr(builtin, "write_builtin", counting)
    results: list[Path] = []
    start = threading.Barrier(4)

    def resolve() -> None:
        start.wait()
        results.append(resolve_model("builtin:tiny", str(tmp_path)))

    threads = [threading.Thread(target=resolve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the flock makes the others wait and reuse the result
    assert results == [tmp_path / "models" / "tiny-v2"] * 4


def test_lost_rename_race_uses_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtin.write_builtin
    target = tmp_path / "models" / "tiny-v2"

    def racing(name: str, dest: Path, seed: int = builtin.SEED) -> None:
        real(name, dest, seed)
        shutil.copytree(dest, target)  # another generator finished first, despite the lock

    monkeypatch.setattr(builtin, "write_builtin", racing)
    assert resolve_model("builtin:tiny", home=str(tmp_path)) == target
    assert (target / builtin.MARKER).is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".lock", "tiny-v2"]


def test_existing_directory_resolves_as_path(tmp_path: Path) -> None:
    path = resolve_model("builtin:tiny", home=str(tmp_path))
    assert resolve_model(str(path)) == path.resolve()


def test_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="'/nonexistent' does not exist"):
        resolve_model("/nonexistent")
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelNotFound, match="is not a directory"):
        resolve_model(str(tmp_path / "file"))
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFound, match=r"unknown built-in model 'builtin:nope'.*builtin:tiny"):
        resolve_model("builtin:nope", home=str(tmp_path))
    assert issubclass(ModelNotFound, ValueError)
    assert not (tmp_path / "models").exists()


def test_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_SIDECAR_HOME", str(tmp_path / "env"))
    assert cache_home() == tmp_path / "env"
    assert cache_home(str(tmp_path / "arg")) == tmp_path / "arg"
    monkeypatch.delenv("MLX_SIDECAR_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(store.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "mlx-sidecar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_home() == tmp_path / "home" / ".cache" / "mlx-sidecar"
    monkeypatch.setattr(store.sys, "platform", "darwin")
    assert cache_home() == tmp_path / "home" / "Library" / "Caches" / "mlx-sidecar"
    monkeypatch.setenv("MLX_SIDECAR_HOME", str(tmp_path / "env"))
    resolve_model("builtin:tiny")  # no home argument: the environment decides
    assert (tmp_path / "env" / "models" / "tiny-v2" / builtin.MARKER).is_file()


def test_small_config_shape() -> None:
    # Cheap: no weights are generated (they are ~270 MB).
    files = builtin.builtin_files("small")
    config, tokenizer = files["config.json"], files["tokenizer.json"]
    assert config["vocab_size"] == 32000 == len(tokenizer["model"]["vocab"])
    assert sorted(tokenizer["model"]["vocab"].values()) == list(range(32000))
    assert tokenizer["model"]["vocab"]["<|reserved_0|>"] == 1024  # the trained part ends there
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: nothing is allocated
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape == (32000, 512)
    assert len(model.layers) == 12


def test_small_generates_and_decodes_padded_ids(home: str) -> None:
    path = resolve_model("builtin:small", home=home)  # generated once per session (test_worker's too)
    model, tokenizer = mlx_lm.load(str(path))
    assert mlx_lm.generate(model, tokenizer, "The keeper", max_tokens=2)
    # Ids past the trained vocab (the model can emit them) decode, streaming or not.
    assert tokenizer.decode([31999]) == "<|reserved_30975|>"
    detok = tokenizer.detokenizer
    detok.reset()
    for token in [31999, 1030, 5]:
        detok.add_token(token)
    detok.finalize()
    assert detok.text.startswith("<|reserved_30975|><|reserved_6|>")


def test_longctx_kv_outweighs_its_weights() -> None:
    """builtin:longctx (the long-context bench model): its fp32 KV at 4096 tokens (16 MiB) exceeds
    its ~10 MiB of weights, and it takes 16k+ positions. Shapes only: nothing is generated."""
    from mlx.utils import tree_flatten

    spec = BUILTIN_MODELS["longctx"]
    config = builtin.builtin_files("longctx")["config.json"]
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy parameters
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for _, v in tree_flatten(model.parameters()))
    kv_bytes_4k = 4096 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 4
    assert kv_bytes_4k == 16 * 2**20
    assert 9 * 2**20 < weight_bytes < 11 * 2**20 < kv_bytes_4k
    assert config["max_position_embeddings"] >= 16384 + 1024
