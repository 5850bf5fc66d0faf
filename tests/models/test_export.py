from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.cli import main
from sidecar.models import ModelNotFound, resolve_model
from sidecar.models.export import model_dir


def test_export_of_a_builtin_has_the_sidecars_config_and_tokenizer_and_no_weights(home: str, tmp_path: Path) -> None:
    src = resolve_model("builtin:tiny", home)
    out = model_dir("builtin:tiny", home, str(tmp_path / "vllm-side"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for f in out.iterdir():
        assert json.loads(f.read_text()) == json.loads((src / f.name).read_text()), f.name
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_export_of_an_embedding_builtin_has_its_sentence_transformers_pooling(home: str, tmp_path: Path) -> None:
    out = model_dir("builtin:tiny-embed", home, str(tmp_path / "vllm-side"))
    modules = json.loads((out / "modules.json").read_text())
    assert any(m.get("type", "").endswith("Pooling") for m in modules)
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_lasttoken"] is True


def test_export_of_a_directory_copies_what_vllm_reads(home: str, tmp_path: Path) -> None:
    src = resolve_model("builtin:tiny-qwen3", home)
    out = model_dir(str(src), home, str(tmp_path / "copy"))
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert not (out / "model.safetensors").exists()
    with pytest.raises(ModelNotFound):
        model_dir("builtin:nope", home, str(tmp_path / "x"))


def test_cli_prints_the_path(home: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-dir", "builtin:tiny", "--home", home]) == 0
    assert capsys.readouterr().out.strip() == str(resolve_model("builtin:tiny", home))
    assert main(["model-dir", "builtin:nope", "--home", home]) == 2
