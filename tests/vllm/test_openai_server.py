"""vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server --worker-cls ...`), unmodified,
over a real sidecar: /v1/completions and streaming /v1/chat/completions give mlx-lm's tokens."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.server.serverproc import start_server
from tests.vllm import apiserver
from tests.vllm.conftest import oracle, sidecar_url_config

N = 10


@contextmanager
def api_server(model: str, sidecar_url: str, served: str, log: Path, *flags: str) -> Iterator[str]:
    """vLLM's OpenAI server over the sidecar at `sidecar_url`; yields its URL."""
    with apiserver.api_server(model, sidecar_url_config(sidecar_url), log, "--kv-cache-memory-bytes", str(1 << 20),
                              "--max-model-len", "256", *flags, served=served) as api:
        yield api.url


@pytest.fixture(scope="module")
def api(home: str, vllm_model_dir, tmp_path_factory: pytest.TempPathFactory):
    model = vllm_model_dir("builtin:tiny")
    log = tmp_path_factory.mktemp("api") / "api_server.log"
    with start_server("--model", "builtin:tiny") as sidecar, api_server(model, sidecar.url, "tiny", log) as url:
        yield url


def test_completions_give_mlx_lms_tokens(api: str, home: str) -> None:
    r = httpx.post(f"{api}/v1/completions", json={
        "model": "tiny", "prompt": "The lighthouse keeper rose", "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = oracle({"model": "builtin:tiny", "prompts": [choice["prompt_token_ids"]], "max_tokens": N}, home)[0]
    assert choice["token_ids"] == want["tokens"]


def test_streaming_chat_completions_give_mlx_lms_tokens(api: str, home: str) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    text, ids = "", []
    with httpx.stream("POST", f"{api}/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                ids += c.get("token_ids") or []
    want = oracle({"model": "builtin:tiny", "chat": messages, "max_tokens": N}, home)
    assert ids == want["tokens"]
    # The stream holds back a trailing incomplete UTF-8 character (random weights end mid-character).
    assert text == want["text"].rstrip("\ufffd") and text
