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

from sidecar.models import vlm_layouts
from sidecar.models.store import MARKER, ensure_generated, init_tensor, write_json
from sidecar.models.vlm_layouts import CLIP_MEAN, CLIP_STD, QWEN_CHAT_TEMPLATE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SEED = 1234
# Qwen2-VL's special tokens (transformers' Qwen2VLProcessor finds the image token by this name).
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>", "<|endoftext|>")


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
                                  "tiny-paddleocr-vl": VLMSpec("paddleocr_vl"), "tiny-lfm2-vl": VLMSpec("lfm2_vl"),
                                  "tiny-internvl": VLMSpec("internvl"),
                                  "small-qwen2.5-vl": VLMSpec("qwen2_5_vl", small=True)}


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
    return vlm_layouts.layout(family, train)


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
