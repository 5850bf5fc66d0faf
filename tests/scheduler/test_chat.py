from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.models import resolve_model
from sidecar.scheduler.chat import load_chat_template, prompt_ids
from sidecar.scheduler.generate import load_tokenizer


def test_chat_needs_a_template(tmp_path: Path, home: str) -> None:
    src = resolve_model("builtin:tiny", home)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    assert load_chat_template(tmp_path) is None
    tok = load_tokenizer(str(src))
    assert prompt_ids(tok, tmp_path, "hi", None) == tok.encode("hi").ids  # no template: raw text
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(tok, tmp_path, "hi", True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                                  "{% endfor %}{% if add_generation_prompt %} >{% endif %}"}))
    assert load_chat_template(tmp_path).render("hi") == "<|bos|>[user] hi >"
