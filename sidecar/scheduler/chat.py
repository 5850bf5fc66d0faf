"""Chat templates for `generate`: render a user prompt with the model's own template (jinja2, as
Hugging Face's `apply_chat_template` does), without importing transformers or MLX."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special: dict[str, str]  # bos_token, eos_token, ... as the template may name them

    def render(self, prompt: str) -> str:
        """The text of one user turn plus the assistant's generation prompt."""
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source).render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **self.special)


def load_chat_template(model_path: str | Path) -> ChatTemplate | None:
    """The model directory's chat template (tokenizer_config.json or chat_template.jinja), or None."""
    path = Path(model_path)
    config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, list):  # the named-templates form: use the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source and (path / "chat_template.jinja").is_file():
        source = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if not source:
        return None
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):  # AddedToken form
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return ChatTemplate(source, special)


def prompt_ids(tokenizer: Any, model_path: str | Path, prompt: str, chat: bool | None) -> list[int]:
    """Token ids for `generate`'s prompt: chat-templated when `chat` (None: when the model has a
    template), else the raw text with the tokenizer's own special tokens (e.g. bos)."""
    template = load_chat_template(model_path) if chat is not False else None
    if chat and template is None:
        raise ValueError(f"--chat: the model at {model_path} has no chat template (use --no-chat)")
    if template is None:
        return tokenizer.encode(prompt).ids
    # The template writes every special token itself, as transformers' apply_chat_template.
    return tokenizer.encode(template.render(prompt), add_special_tokens=False).ids
