"""The generated vision-language built-ins' files for the families beyond Qwen-VL (models/vlm_builtin.py
writes them): Gemma 3, Idefics3 and SmolVLM, Mistral 3, GLM-4.1V and GLM-4.5V, PaddleOCR-VL, LFM2-VL,
InternVL. Each is the family's real layout at a tiny size: its config, its processor's config and a
tokenizer with its image tokens and a chat template that places them."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # image normalisation
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# ChatML with Qwen-VL's image markers (models/vlm_builtin.py); LFM2-VL's is the same with its own.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

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


def gemma3(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
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


def idefics3(train: Callable[[int], Tokenizer], smol: bool = False) -> dict[str, dict]:
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


def mistral3(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
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


def glm4v(train: Callable[[int], Tokenizer], moe: bool = False) -> dict[str, dict]:
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


PADDLE_TOKENS = ("<s>", "</s>", "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|VIDEO_PLACEHOLDER|>")
PADDLE_CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}User: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% else %}Assistant: {{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def paddleocr_vl(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    """PaddleOCR-VL's layout: a NaViT tower over patches of 14 at the image's own size (one frame),
    merged 2x2 by its projector into ERNIE-4.5's decoder with M-RoPE; text settings at the root."""
    tok = train(512)
    tok.post_processor = None  # the chat template writes <s>
    tok.add_special_tokens(list(PADDLE_TOKENS))
    ids = {t: tok.token_to_id(t) for t in PADDLE_TOKENS}
    vision = {"model_type": "paddleocr_vl", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_channels": 3, "image_size": 56, "patch_size": 14,
              "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "spatial_merge_size": 2}
    # mlx-vlm's projector writes 1024 wide (the real decoder's width): the decoder is that wide here too
    text = {"hidden_size": 1024, "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": tok.get_vocab_size(),
            "max_position_embeddings": 4096, "rope_theta": 500000.0, "hidden_act": "silu", "use_bias": False,
            "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
    config = {"architectures": ["PaddleOCRVLForConditionalGeneration"], "model_type": "paddleocr_vl", **text,
              "text_config": {"model_type": "paddleocr_vl", **text}, "vision_config": vision, "image_token_id": ids["<|IMAGE_PLACEHOLDER|>"],
              "video_token_id": ids["<|VIDEO_PLACEHOLDER|>"], "vision_start_token_id": ids["<|IMAGE_START|>"],
              "vision_end_token_id": ids["<|IMAGE_END|>"], "torch_dtype": "float32"}
    image = {"image_processor_type": "SiglipImageProcessor", "processor_class": "PaddleOCRVLProcessor",
             "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
             "rescale_factor": 1 / 255, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "min_pixels": (2 * 28) ** 2, "max_pixels": (4 * 28) ** 2, "patch_size": 14, "temporal_patch_size": 1,
             "merge_size": 2}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False, "chat_template": PADDLE_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": ids["</s>"], "do_sample": False}}



LFM_TOKENS = ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<image>", "<|image_start|>", "<|image_end|>",
              "<|img_thumbnail|>")
LFM_CHAT_TEMPLATE = "<|startoftext|>" + QWEN_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def lfm2_vl(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    """LFM2-VL's layout: SigLIP2's NaFlex tower over packed patches of 16 at the image's own aspect
    ratio, pixel-unshuffled 2x2 into LFM2's hybrid decoder (short convolutions and attention)."""
    tok = train(512)
    tok.post_processor = None
    tok.add_special_tokens(list(LFM_TOKENS))
    ids = {t: tok.token_to_id(t) for t in LFM_TOKENS}
    text = {"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_heads": 4, "max_position_embeddings": 4096,
            "rope_theta": 1000000.0, "vocab_size": tok.get_vocab_size(), "norm_eps": 1e-5, "block_dim": 64,
            "block_ff_dim": 128, "block_auto_adjust_ff_dim": False, "conv_L_cache": 3, "conv_bias": False,
            "conv_dim": 64, "conv_dim_out": 64, "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1],
            "tie_word_embeddings": True, "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_channels": 3, "patch_size": 16, "num_patches": 256,
              "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
    config = {"architectures": ["Lfm2VlForConditionalGeneration"], "model_type": "lfm2_vl", "text_config": text,
              "vision_config": vision, "image_token_id": ids["<image>"], "downsample_factor": 2,
              "encoder_patch_size": 16, "projector_hidden_size": 64, "projector_hidden_act": "gelu",
              "projector_bias": True, "projector_use_layernorm": True, "vision_feature_layer": -1,
              "min_image_tokens": 16, "max_image_tokens": 64, "max_num_patches": 256, "tile_size": 128,
              "do_image_splitting": True, "use_image_special_tokens": True, "use_thumbnail": True,
              "eos_token_id": ids["<|im_end|>"], "tie_word_embeddings": True, "hidden_size": 64, "torch_dtype": "float32"}
    image = {"image_processor_type": "Lfm2VlImageProcessorFast", "processor_class": "Lfm2VlProcessor",
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "downsample_factor": 2, "encoder_patch_size": 16, "min_image_tokens": 16,
             "max_image_tokens": 64, "tile_size": 128, "max_pixels_tolerance": 2.0, "resample": 2}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": LFM_CHAT_TEMPLATE,
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "processor_config.json": {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True},
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": ids["<|im_end|>"], "do_sample": False}}


INTERNVL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<img>", "</img>", "<IMG_CONTEXT>")
# InternVL's Hugging Face layout (InternVL3.5-hf): ChatML, each image marked by <IMG_CONTEXT>, which
# the processor expands into <img>, the image's context tokens and </img>.
INTERNVL_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")
INTERNVL_TILE = 56  # 4x4 patches of 14, pixel-shuffled 2x2: 4 tokens per tile; up to 4 tiles and a thumbnail


def internvl(train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    """InternVL's layout (InternVL3.5, Hugging Face format): InternViT over square tiles of the image
    (its closest aspect ratio's grid, and a thumbnail), each pixel-shuffled 2x2 into Qwen3's decoder."""
    tok = train(512)
    tok.post_processor = None
    tok.add_special_tokens(list(INTERNVL_TOKENS))
    ids = {t: tok.token_to_id(t) for t in INTERNVL_TOKENS}
    text = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 4096, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
    vision = {"model_type": "internvl_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": [INTERNVL_TILE] * 2, "patch_size": [14, 14], "num_channels": 3,
              "layer_norm_eps": 1e-6, "norm_type": "layer_norm", "use_qk_norm": False, "attention_bias": True,
              "hidden_act": "gelu", "layer_scale_init_value": 0.1}
    config = {"architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl", "text_config": text,
              "vision_config": vision, "image_token_id": ids["<IMG_CONTEXT>"], "downsample_ratio": 0.5,
              "projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
              "max_dynamic_patch": 4, "min_dynamic_patch": 1, "use_thumbnail": True, "hidden_size": 64,
              "torch_dtype": "float32"}
    image = {"image_processor_type": "GotOcr2ImageProcessor", "processor_class": "InternVLProcessor",
             "crop_to_patches": True, "min_patches": 1, "max_patches": 4, "size": {"height": INTERNVL_TILE,
                                                                                  "width": INTERNVL_TILE},
             "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD, "do_convert_rgb": True}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False, "chat_template": INTERNVL_CHAT_TEMPLATE,
        "context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
    }
    return {"config.json": config, "preprocessor_config.json": image, "tokenizer_config.json": tokenizer_config,
            "processor_config.json": {"processor_class": "InternVLProcessor", "image_seq_length": 4},
            "tokenizer.json": json.loads(tok.to_str()),
            "generation_config.json": {"eos_token_id": ids["<|im_end|>"], "do_sample": False}}


def layout(family: str, train: Callable[[int], Tokenizer]) -> dict[str, dict]:
    """The files of `family`'s tiny built-in."""
    if family == "smolvlm":
        return idefics3(train, smol=True)
    if family == "glm4v_moe":
        return glm4v(train, moe=True)
    return {"gemma3": gemma3, "idefics3": idefics3, "mistral3": mistral3, "glm4v": glm4v,
            "paddleocr_vl": paddleocr_vl, "lfm2_vl": lfm2_vl, "internvl": internvl}[family](train)
