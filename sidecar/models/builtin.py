"""Built-in models: small mlx-lm model directories generated on first use.

A fresh machine without network access can still serve and test: each built-in is a byte-level
BPE tokenizer trained on the text below plus random weights from a fixed seed, written as an
ordinary mlx-lm model directory under ``<home>/models/<name>-v<version>``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.models import families, gguf, vlm_builtin
from sidecar.models.store import (
    BUILTIN_PREFIX,
    MARKER,
    ModelNotFound,
    ensure_generated,
    generated_dir,
    init_tensor,
    is_complete,
    write_json,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
SEED = 1234
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen2": "Qwen2ForCausalLM"}  # transformers names


@dataclass(frozen=True)
class BuiltinSpec:
    model_type: str  # mlx-lm family: "llama" or "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    bpe_vocab: int  # BpeTrainer target (the text supports ~1150 at most)
    vocab_size: int | None = None  # embedding rows; > tokenizer size pads with reserved tokens
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    version: int = 2  # bump whenever the generated files change (2: chat template)
    extra_config: dict | None = None  # family-specific config keys (sidecar.models.families)
    pooling: str | None = None  # "embed" (sentence-transformers files) | "classify" (a `score` head)


_TINY = BuiltinSpec(
    "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, tie_word_embeddings=False, bpe_vocab=512,
)
BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny": _TINY,
    "tiny-qwen3": replace(_TINY, model_type="qwen3", tie_word_embeddings=True, rope_theta=1e6),
    # mlx-lm's qwen2 has both shard() and pipeline() (llama/qwen3 only shard): the scale-out
    # tests' pipeline-parallel model. 4 heads, 2 KV heads and 2 layers split evenly over 2 ranks.
    # Untied: with tied embeddings these random weights mostly repeat the input token.
    "tiny-qwen2": replace(_TINY, model_type="qwen2"),
    # Heads of 64: mlx-lm's KV quantisation (group size 64) applies (the kv_dtype 8bit/4bit tests).
    "tiny-kv64": replace(_TINY, head_dim=64),
    # The same heads of 64 on qwen2 (head size = hidden / heads, and pipeline()): kv_dtype 8bit scale-out.
    "tiny-qwen2-kv64": replace(_TINY, model_type="qwen2", hidden_size=256, head_dim=64),
    # Sized so one batch-1 decode step (1 token, ~100 cached) costs ~34 ms on a 2-core x86 CPU
    # (>= 20 ms wanted), with a 32000-row vocabulary padded past the tokenizer like real models.
    "small": BuiltinSpec(
        "llama", hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=1408, tie_word_embeddings=False, bpe_vocab=1024, vocab_size=32000,
    ),
    # For long-context decode: ~10 MiB of fp32 weights, 4 KiB of KV per token (16 MiB at 4096
    # tokens, more than the weights), as an 8B 4-bit model near 32k tokens; 32k positions.
    # A Qwen3-architecture embedding model: last-token pooling, normalised (as Qwen3-Embedding).
    "tiny-embed": replace(_TINY, model_type="qwen3", tie_word_embeddings=True, rope_theta=1e6, pooling="embed"),
    # A one-label sequence classifier (a cross-encoder for score/rerank): the decoder and a `score`
    # head, no LM head, as transformers' LlamaForSequenceClassification checkpoints ship it.
    "tiny-classify": replace(_TINY, pooling="classify"),
    "longctx": BuiltinSpec(
        "llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=512, tie_word_embeddings=False, bpe_vocab=512, max_position_embeddings=32768,
    ),
}

# Original text, the tokenizer's whole training corpus. Changing it changes every built-in
# tokenizer: bump the versions.
CORPUS = """\
The lighthouse keeper rose before the sun, as she had done for eleven years. She climbed the
ninety-two steps with a lamp in one hand and a mug of tea in the other, counting each step out of
habit rather than need. At the top she wiped the salt from the glass, trimmed the wick, and wrote
the weather in a small green book: wind from the west, light rain, a grey sea turning silver.

Down in the village the baker was already at work. Flour drifted through the air like slow snow,
settling on the shelves, the windows and the sleeping cat. He shaped the loaves by feel, pressing
and folding until the dough pushed back against his palms. When the first tray came out of the
oven, the whole street smelled of warm bread, and the fishermen walking to the harbour slowed
their pace without quite knowing why.

A river does not hurry, yet it reaches the sea. It bends around stones instead of breaking them,
and over many seasons the stones are shaped by the water that seemed to yield to them. Patience is
not the same thing as waiting; it is the choice to keep moving at the speed the work requires.

Every morning the children walked to school along the old stone wall. They balanced on its narrow
top with their arms held wide, calling out the names of birds they saw: a robin on the gate, two
crows in the field, a heron standing still as a post in the shallow water of the ditch. Their
teacher said that paying attention was the beginning of every kind of learning.

In the workshop at the end of the lane, an old clockmaker repaired watches that other people had
given up on. He worked under a bright lamp with tweezers and tiny screwdrivers, opening each case
as if it were a letter. Most clocks, he liked to say, are not broken; they are only tired, and
they want someone to listen to them for a while before they will tell the time again.

Numbers have their own quiet stories. One and one make two, two and three make five, and the
sequence goes on, each term the sum of the two before it: eight, thirteen, twenty-one, thirty-four.
A square has four equal sides and four right angles; a circle has no corners at all. The
distance around a circle divided by the distance across it is always the same, a little more
than three, whether the circle is a coin, a wheel or the orbit of a distant moon.

When the storm finally arrived it came from the north, faster than anyone expected. The boats in
the harbour pulled at their ropes, the shutters rattled, and the lighthouse beam swept through the
dark rain like a slow, patient hand. By midnight the wind had dropped, and by morning the sky was
washed clean, blue and cold, with a few small clouds hurrying east as if they were late.

Good software is a little like a well kept garden. You plant carefully, you remove what does not
belong, and you return often to see what has changed. Tests are the fences that keep the rabbits
out; logs are the footprints that show where something walked in the night. A simple design that
everyone understands will outlive a clever one that only its author can explain.

The market opened at nine. Stalls offered apples, pears, honey in glass jars, wool in every colour,
and second-hand books with notes in their margins. A woman sold small paintings of the coast, each
one no bigger than a postcard, and she would tell you exactly which rock or wave you were looking
at, and what the weather had been on the day she painted it.

At the end of the day the keeper climbed the steps once more. The sea was calm and the first
stars were coming out above the headland. She lit the lamp, watched the beam turn once, twice,
three times across the water, and then sat down with her book to write: clear evening, light
wind, all ships accounted for. Then she closed the book and listened to the waves.
"""


def resolve_model(name: str, home: str | None = None) -> Path:
    """A model directory for ``name``: ``builtin:<n>`` (generated on first use) or a local path."""
    if name.startswith(BUILTIN_PREFIX):
        builtin = name[len(BUILTIN_PREFIX) :]
        if builtin in gguf.GGUF_MODELS:
            return gguf.ensure_gguf(builtin, home)
        if builtin in vlm_builtin.VLM_MODELS:
            return vlm_builtin.ensure_vlm(builtin, train_tokenizer, home)
        if builtin not in BUILTIN_MODELS:
            raise ModelNotFound(
                f"unknown built-in model {name!r}; available: "
                + ", ".join(BUILTIN_PREFIX + n for n in [*BUILTIN_MODELS, *gguf.GGUF_MODELS, *vlm_builtin.VLM_MODELS])
            )
        return ensure_builtin(builtin, home)
    path = Path(name).expanduser()
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise ModelNotFound(
            f"model path {name!r} {problem} (expected {BUILTIN_PREFIX}<name> or a local "
            "mlx-lm model directory; models are never downloaded)"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{name!r} is not an mlx-lm model directory: it has no config.json")
    return path.resolve()


def needs_building(name: str, home: str | None = None) -> bool:
    """True when resolving ``name`` would generate a built-in first (it is not on disk yet)."""
    builtin = name.removeprefix(BUILTIN_PREFIX)
    spec = BUILTIN_MODELS.get(builtin) or gguf.GGUF_MODELS.get(builtin) or vlm_builtin.VLM_MODELS.get(builtin)
    if not name.startswith(BUILTIN_PREFIX) or spec is None:
        return False
    return not is_complete(generated_dir(builtin, spec.version, home))


def ensure_builtin(name: str, home: str | None = None) -> Path:
    """Return the complete directory of generated built-in ``name``, generating it once if needed."""
    return ensure_generated(name, BUILTIN_MODELS[name].version, write_builtin, home)


def write_builtin(name: str, dest: Path, seed: int = SEED) -> None:
    """Write the files of built-in ``name`` into the existing directory ``dest``, marker last."""
    files = builtin_files(name)
    for filename, content in files.items():
        (dest / filename).parent.mkdir(exist_ok=True)
        write_json(dest / filename, content)
    _write_weights(files["config.json"], dest / "model.safetensors", seed)
    marker = {"builtin": name, "version": BUILTIN_MODELS[name].version, "seed": seed}
    write_json(dest / MARKER, marker)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def builtin_files(name: str) -> dict[str, dict]:
    """The JSON files of built-in ``name`` (everything but the weights), by file name."""
    spec = BUILTIN_MODELS[name]
    tok = json.loads(train_tokenizer(spec.bpe_vocab).to_str())
    vocab_size = _pad_vocab(tok, spec.vocab_size)
    bos, eos, pad = (tok["model"]["vocab"][t] for t in SPECIAL_TOKENS)
    config = {
        "architectures": [_ARCHITECTURES.get(spec.model_type, "")],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": 1e-5 if spec.model_type == "llama" else 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        **(spec.extra_config or {}),
    }
    tokenizer_config = {
        # Without tokenizer_class, transformers picks the family's tokenizer class from
        # config.json (e.g. LlamaTokenizer), which rebuilds the pipeline instead of using ours.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        # A plain role-prefixed transcript, so chat APIs (vLLM's /v1/chat/completions) work.
        "chat_template": CHAT_TEMPLATE,
    }
    files = {"config.json": config, "tokenizer_config.json": tokenizer_config, "tokenizer.json": tok}
    files.update(_pooling_files(spec, config))
    return files


def _pooling_files(spec: BuiltinSpec, config: dict) -> dict[str, dict]:
    """An embedding model's sentence-transformers files (vLLM and the worker read its pooling from
    them), or a classifier's config keys."""
    if spec.pooling == "classify":
        config.update(architectures=[config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                      num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        return {}
    if spec.pooling != "embed":
        return {}
    config["is_matryoshka"] = True  # any `dimensions` (vLLM checks this flag)
    return {
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                         {"idx": 2, "name": "2", "path": "2_Normalize",
                          "type": "sentence_transformers.models.Normalize"}],
        "1_Pooling/config.json": {"word_embedding_dimension": spec.hidden_size, "pooling_mode_lasttoken": True,
                                  "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False,
                                  "include_prompt": True},
        "2_Normalize/config.json": {},
        "config_sentence_transformers.json": {"similarity_fn_name": "cosine"},
    }


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on CORPUS. Deterministic: the tests compare tokenizer.json across runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    bos = SPECIAL_TOKENS[0]
    # Prepend bos like llama-style tokenizers; mlx-lm and transformers then agree on prompts.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def _pad_vocab(tok: dict, size: int | None) -> int:
    """Give every id below ``size`` a token, so any id the model emits decodes.

    The padding goes into the BPE vocab, not added_tokens: no merge reaches these strings, so
    text never encodes to them (no injection), and transformers loads 30k added tokens ~30x
    slower. Their characters are printable ASCII, which the byte-level decoder maps to itself.
    """
    vocab: dict[str, int] = tok["model"]["vocab"]
    n = len(vocab)
    if size is None:
        return n
    if size < n:
        raise ValueError(f"vocab_size {size} is smaller than the tokenizer ({n})")
    vocab.update((f"<|reserved_{i}|>", n + i) for i in range(size - n))
    return size


def _write_weights(config: dict, path: Path, seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config))  # lazy: its own init never runs
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    weights = {k: mx.array(init_tensor(k, shape, config, seed)) for k, shape in sorted(shapes.items())}
    model.load_weights(list(weights.items()), strict=True)  # checks names and shapes
    if str(config["architectures"][0]).endswith("ForSequenceClassification"):
        del weights["lm_head.weight"]
        weights["score.weight"] = mx.array(init_tensor("score.weight", (config["num_labels"], config["hidden_size"]),
                                                       config, seed))
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


# Tiny random models of more mlx-lm families (windows, sinks, MLA, recurrent layers).
BUILTIN_MODELS.update(families.builtin_specs(_TINY))
