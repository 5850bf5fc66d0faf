"""Tiny generated vision-language built-ins: random weights, real processor configs.

Each is a checkpoint directory as the family's real ones are laid out (config.json with a
``vision_config``, preprocessor_config.json, a tokenizer with the family's image tokens and a chat
template that places them), so vLLM's own processor and mlx-vlm's prepare the images, and
mlx-vlm's model code loads the weights. Sized to run in milliseconds: images of 56-112 pixels a
side give 4-16 placeholder tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sidecar.models.store import MARKER, ensure_generated, init_tensor, write_json

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SEED = 1234
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # image normalisation
# Qwen2-VL's special tokens (transformers' Qwen2VLProcessor finds the image token by this name).
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>", "<|endoftext|>")
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VLMSpec:
    model_type: str  # mlx-vlm family
    version: int = 1  # bump whenever the generated files change
    small: bool = False  # the benchmarks' size (QWEN_SMALL), else tiny


VLM_MODELS: dict[str, VLMSpec] = {"tiny-qwen2-vl": VLMSpec("qwen2_vl"), "tiny-qwen2.5-vl": VLMSpec("qwen2_5_vl"),
                                  "tiny-qwen3-vl": VLMSpec("qwen3_vl"), "tiny-qwen3-vl-moe": VLMSpec("qwen3_vl_moe"),
                                  "tiny-gemma3-vl": VLMSpec("gemma3"), "tiny-idefics3": VLMSpec("idefics3"),
                                  "tiny-mistral3": VLMSpec("mistral3"), "tiny-smolvlm": VLMSpec("smolvlm"),
                                  "tiny-glm4v": VLMSpec("glm4v"), "tiny-glm4v-moe": VLMSpec("glm4v_moe"),
                                  "small-qwen2.5-vl": VLMSpec("qwen2_5_vl", small=True)}

IDEFICS_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                  "<global-img>")
IDEFICS_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
# SmolVLM (SmolVLM2): Idefics3's model under its own name, processor and turn markers.
SMOLVLM_CHAT_TEMPLATE = IDEFICS_CHAT_TEMPLATE.replace("<|begin_of_text|>{% for m in messages %}",
                                                      "<|im_start|>{% for m in messages %}")
IDEFICS_TILE = 56  # 4x4 patches of 14, pixel-shuffled 2x2: 4 tokens per tile; images split into tiles of 56 up to 112

GEMMA_TOKENS = ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                "<image_soft_token>")
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_IMAGE_SIZE, GEMMA_IMAGE_TOKENS = 56, 4  # 4x4 patches of 14, pooled 2x2: 4 soft tokens per image


def ensure_vlm(name: str, train: Callable[[int], Tokenizer], home: str | None = None) -> Path:
    """`train`: the built-ins' tokenizer trainer (models/builtin.py), given the BPE vocabulary size."""
    return ensure_generated(name, VLM_MODELS[name].version, lambda n, dest: write_vlm(n, dest, train), home)


def write_vlm(name: str, dest: Path, train: Callable[[int], Tokenizer], seed: int = SEED) -> None:
    """Write built-in ``name`` into the existing directory ``dest``, marker last."""
    files = vlm_files(name, train)
    for filename, content in files.items():
        write_json(dest / filename, content)
    _write_weights(files["config.json"], dest / "model.safetensors", seed)
    write_json(dest / MARKER, {"builtin": name, "version": VLM_MODELS[name].version, "seed": seed})


def vlm_files(name: str, train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    family = VLM_MODELS[name].model_type
    if family.startswith("qwen"):
        return _qwen_vl(train, family, VLM_MODELS[name].small)
    if family == "smolvlm":
        return _idefics3(train, smol=True)
    return {"gemma3": _gemma3, "idefics3": _idefics3, "mistral3": _mistral3, "glm4v": _glm4v,
            "glm4v_moe": lambda t: _glm4v(t, moe=True)}[family](train)


# Qwen2.5-VL's vision tower differs from Qwen2-VL's: RMSNorm and SwiGLU blocks, windowed attention
# (windows of 56 pixels: 2x2 merged tokens, so an image of up to 4x4 tokens spans several) with
# full attention in the blocks listed, and a merger projecting to the text width. Qwen3-VL's: patches
# of 16, learned position embeddings interpolated to the grid, and "deepstack" mergers whose outputs
# are added to the hidden states after the first decoder layers (one per listed block).
QWEN_VISION = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
                   "hidden_act": "silu", "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2},
    "qwen3_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
                 "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
}
QWEN_VISION["qwen3_vl_moe"] = QWEN_VISION["qwen3_vl"]
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}
# Qwen3-VL-MoE's decoder: every layer's MLP is 4 experts, 2 per token.
QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "moe_intermediate_size": 32, "norm_topk_prob": True}
# builtin:small-qwen2.5-vl, for benchmarks: Qwen2.5-VL-7B's cost proportions at a size MLX's CPU
# backend prefills in about a second. Per token its language model costs 1.18M multiply-adds
# (7B: 6.5G); per image token (4 patches of 14 pixels, merged 2x2) its tower costs
# 4 x (38K patch embedding + 66K blocks) + 33K merger = 0.45M (7B: 4 x (1.5M + 630M) + 45M): 0.38 of
# a token's cost (7B: 0.39). Windows of 112 pixels with full attention in 1 block of 4 (7B: 4 of
# 32); images up to 448 pixels a side (256 tokens), as a photo's share of a prompt.
QWEN_SMALL = {
    "text": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 640, "rope_scaling": {"type": "mrope", "rope_type": "default",
                                                        "mrope_section": [4, 6, 6]}},
    "vision": {"depth": 4, "hidden_size": 32, "intermediate_size": 128, "out_hidden_size": 128, "num_heads": 2,
               "hidden_act": "silu", "window_size": 112, "fullatt_block_indexes": [3], "tokens_per_second": 2},
    "max_pixels": 448 * 448,
}


def _qwen_vl(train: Callable[[int], Tokenizer], family: str, small: bool = False) -> dict[str, dict]:
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                 "qwen3_vl_moe": "Qwen3VLProcessor"}[family]
    qwen3, patch = family.startswith("qwen3"), PATCH[family]
    # 4x4 .. 8x8 patches: 4 .. 16 tokens after 2x2 merging
    min_pixels, max_pixels = (4 * patch) ** 2, QWEN_SMALL["max_pixels"] if small else (8 * patch) ** 2
    tok = train(512)
    tok.post_processor = None  # Qwen tokenizers add no BOS: the template carries every marker
    tok.add_special_tokens(list(QWEN_TOKENS))
    ids = {t: tok.token_to_id(t) for t in QWEN_TOKENS}
    vocab = tok.get_vocab_size()
    text = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "hidden_act": "silu", "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        # M-RoPE: head_dim 16 -> 8 frequencies split over (temporal, height, width); Qwen3-VL
        # interleaves them (t h w t h w t t), as its real sections [24, 20, 20] of 64 do
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]},
        "torch_dtype": "float32", "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        **(QWEN_SMALL["text"] if small else {}),
        **({"head_dim": 16, "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2],
                                             "mrope_interleaved": True}} if qwen3 else {}),
        **(QWEN3_MOE if family == "qwen3_vl_moe" else {}),
    }
    vision = {
        "model_type": family, **(QWEN_SMALL["vision"] if small else QWEN_VISION[family]), "in_channels": 3, "in_chans": 3,
        "patch_size": patch, "spatial_patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    config = {
        "architectures": [processor.replace("Processor", "MoeForConditionalGeneration" if family.endswith("moe") else
                                            "ForConditionalGeneration")], "model_type": family, **text,
        "text_config": {"model_type": f"{family}_text", **text}, "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
    }
    mean, std = ([0.5] * 3, [0.5] * 3) if qwen3 else (CLIP_MEAN, CLIP_STD)
    image = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "image_mean": mean, "image_std": std, "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": processor,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": QWEN_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": ids["<|im_end|>"], "do_sample": False}}


def _gemma3(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    tok = train(512)
    tok.post_processor = None  # the chat template writes <bos>
    tok.add_special_tokens(list(GEMMA_TOKENS))
    ids = {t: tok.token_to_id(t) for t in GEMMA_TOKENS}
    text = {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": tok.get_vocab_size(),
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 1000000.0,
        "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0, "max_position_embeddings": 4096,
        "mm_tokens_per_image": GEMMA_IMAGE_TOKENS, "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "float32", "tie_word_embeddings": True,
    }
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": GEMMA_IMAGE_SIZE, "patch_size": 14, "num_channels": 3,
              "layer_norm_eps": 1e-6, "vision_use_head": False}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": vision, "hidden_size": 64, "mm_tokens_per_image": GEMMA_IMAGE_TOKENS,
        "image_token_index": ids["<image_soft_token>"], "image_token_id": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "torch_dtype": "float32",
    }
    image = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
             "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
             "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
             "size": {"height": GEMMA_IMAGE_SIZE, "width": GEMMA_IMAGE_SIZE}, "do_pan_and_scan": False}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "Gemma3Processor",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": GEMMA_CHAT_TEMPLATE, "add_bos_token": False,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA_IMAGE_TOKENS},
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": config["eos_token_id"], "do_sample": False}}


def _idefics3(train: Callable[[int], Tokenizer], smol: bool = False) -> dict[str, dict]:
    tok = train(512)
    tok.post_processor = None  # the chat template writes <|begin_of_text|>
    tok.add_special_tokens(list(IDEFICS_TOKENS) + ["<|im_start|>"] * smol)
    ids = {t: tok.token_to_id(t) for t in IDEFICS_TOKENS}
    name, bos = ("SmolVLM", "<|im_start|>") if smol else ("Idefics3", "<|begin_of_text|>")
    text = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": tok.get_vocab_size(), "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "float32", "pad_token_id": ids["<|end_of_text|>"]}
    vision = {"model_type": f"{name.lower()}_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": IDEFICS_TILE, "patch_size": 14, "num_channels": 3,
              "layer_norm_eps": 1e-6}
    config = {"architectures": [f"{name}ForConditionalGeneration"], "model_type": name.lower(), "text_config": text,
              "vision_config": vision, "scale_factor": 2, "image_token_id": ids["<image>"], "hidden_size": 64,
              "vocab_size": tok.get_vocab_size(), "bos_token_id": tok.token_to_id(bos),
              "eos_token_id": ids["<end_of_utterance>"], "pad_token_id": ids["<|end_of_text|>"], "torch_dtype": "float32",
              "tie_word_embeddings": False}
    image = {"image_processor_type": f"{name}ImageProcessor", "processor_class": f"{name}Processor",
             "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": 2 * IDEFICS_TILE}, "resample": 1,
             "do_image_splitting": True, "max_image_size": {"longest_edge": IDEFICS_TILE}, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_pad": True}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": f"{name}Processor",
        "bos_token": bos, "eos_token": "<end_of_utterance>", "pad_token": "<|end_of_text|>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": SMOLVLM_CHAT_TEMPLATE if smol else IDEFICS_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "processor_config.json": {"processor_class": f"{name}Processor", "image_seq_len": 4},
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": config["eos_token_id"], "do_sample": False}}


MISTRAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST]"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}[IMG]{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
MISTRAL_IMAGE = 112  # the longest edge: up to 8x8 patches of 14, merged 2x2: up to 4x4 tokens, a break after each row


def _mistral3(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    """Mistral 3's layout (Ministral 3, Mistral Small 3.x): Pixtral's tower (2-D RoPE over any aspect
    ratio), a patch merger, and rows of [IMG] tokens closed by [IMG_BREAK] (the last by [IMG_END])."""
    tok = train(512)
    tok.post_processor = None  # the chat template writes <s>
    tok.add_special_tokens(list(MISTRAL_TOKENS))
    ids = {t: tok.token_to_id(t) for t in MISTRAL_TOKENS}
    # Ministral 3's decoder: attention scaled up past the original context (16 positions here,
    # so the tests' prompts cross it; 16384 in the real ones)
    text = {"model_type": "ministral3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": tok.get_vocab_size(),
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "llama_4_scaling_beta": 0.5,
                                "original_max_position_embeddings": 16},
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "head_dim": 16, "image_size": MISTRAL_IMAGE, "patch_size": 14,
              "num_channels": 3, "rope_theta": 10000.0, "hidden_act": "silu"}
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
              "vision_config": vision, "image_token_index": ids["[IMG]"], "spatial_merge_size": 2,
              "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
              "vocab_size": tok.get_vocab_size(), "hidden_size": 64, "bos_token_id": ids["<s>"],
              "eos_token_id": ids["</s>"], "torch_dtype": "float32"}
    image = {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
             "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": MISTRAL_IMAGE}, "resample": 3,
             "patch_size": {"height": 14, "width": 14}, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "PixtralProcessor", "bos_token": "<s>",
        "eos_token": "</s>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": MISTRAL_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "processor_config.json": {"processor_class": "PixtralProcessor", "image_token": "[IMG]",
                                      "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
                                      "patch_size": 14, "spatial_merge_size": 2},
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": ids["</s>"], "do_sample": False}}


GLM_TOKENS = ("[gMASK]", "<sop>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|end_of_image|>",
              "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>", "<|begin_of_box|>", "<|end_of_box|>")
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# GLM-4.5V / GLM-4.6V's decoder: GLM-4.5's experts (a dense first layer, a shared expert, grouped routing).
GLM_MOE = {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
           "first_k_dense_replace": 1, "use_qk_norm": True, "head_dim": 16, "tie_word_embeddings": False}


def _glm4v(train: Callable[[int], Tokenizer], moe: bool = False) -> dict[str, dict]:
    """GLM-4.1V / GLM-4.6V-Flash's layout (`moe`: GLM-4.5V / GLM-4.6V's): Qwen2-VL's patches (14, 2
    frames, merged 2x2) into a tower with learned position embeddings and a downsampling merger;
    GLM-4's decoder with partial M-RoPE."""
    family = "glm4v_moe" if moe else "glm4v"
    tok = train(512)
    tok.post_processor = None  # the chat template writes [gMASK]<sop>
    tok.add_special_tokens(list(GLM_TOKENS))
    ids = {t: tok.token_to_id(t) for t in GLM_TOKENS}
    text = {"model_type": f"{family}_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": tok.get_vocab_size(), "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "partial_rotary_factor": 0.5,
            "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}, "attention_bias": True,
            "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"]], "pad_token_id": ids["<|endoftext|>"],
            "torch_dtype": "float32", **(GLM_MOE if moe else {})}
    vision = {"model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "patch_size": 14, "image_size": 56, "in_channels": 3, "out_hidden_size": 64, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    config = {"architectures": ["Glm4vMoeForConditionalGeneration" if moe else "Glm4vForConditionalGeneration"],
              "model_type": family, "text_config": text,
              "vision_config": vision, "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
              "image_start_token_id": ids["<|begin_of_image|>"], "image_end_token_id": ids["<|end_of_image|>"],
              "vision_start_token_id": ids["<|begin_of_image|>"], "vision_end_token_id": ids["<|end_of_image|>"],
              "vocab_size": tok.get_vocab_size(), "hidden_size": 64, "eos_token_id": text["eos_token_id"],
              "torch_dtype": "float32"}
    pixels = (4 * 28) ** 2  # at most 8x8 patches: 16 tokens after merging
    image = {"image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor", "do_resize": True,
             "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
             "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "size": {"shortest_edge": (2 * 28) ** 2, "longest_edge": pixels},
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False, "chat_template": GLM_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": text["eos_token_id"], "do_sample": False}}


def _write_weights(config: dict, path: Path, seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))  # mlx-vlm's from_dict rewrites its argument
    family, _ = get_model_and_args(config)
    config.setdefault("text_config", {})
    model_config = family.ModelConfig.from_dict(config)
    model = family.Model(update_module_configs(model_config, family, config, ["text", "vision"]))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    weights = {k: mx.array(init_tensor(k, shape, config, seed)) for k, shape in sorted(shapes.items())}
    model.load_weights(list(weights.items()), strict=True)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
