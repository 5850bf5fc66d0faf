"""Tiny random models of many mlx-lm architectures, for correctness tests and built-ins.

Each family is a config small enough to build in milliseconds (hidden 64, 2-4 layers) that
still exercises what is distinctive about it: sliding windows shorter than a test's context,
several experts, MLA ranks, attention sinks, recurrent layers. Configs start from one shared
base (many naming variants at once: `ModelArgs.from_dict` keeps the keys a family knows) plus
per-family overrides read from that family's `ModelArgs`.
"""

from __future__ import annotations

import importlib
import json
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from sidecar.models.store import init_tensor

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None,
    # GPT-2 style names
    "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "n_ctx": 512, "n_inner": 128,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "num_local_experts": 4, "n_routed_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}
_MLA = {"rope_scaling": {"factor": 1.0}, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 20}
_MAMBA = {"state_size": 8, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 8,
          "n_groups": 1, "time_step_limit": [0.0, float("inf")], "num_heads": 4, "head_dim": 32,
          "intermediate_size": 128}

# family -> overrides of _BASE. Windows (8) and chunks (8) are shorter than the tests' contexts.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "phi3": {}, "cohere": {}, "starcoder2": {},
    "internlm2": {}, "internlm3": {}, "exaone": {"num_layers": 2}, "glm": {}, "olmo2": {}, "mimo": {}, "smollm3": {},
    "seed_oss": {}, "nemotron": {"hidden_act": "relu2"}, "phi": {}, "gpt2": {}, "hunyuan_v1_dense": {},
    "nanochat": {}, "telechat3": {}, "youtu_llm": {}, "talkie": {}, "nanbeige": {}, "laguna": {},
    "mixtral": _MOE, "phimoe": _MOE, "deepseek": {**_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "qwen3_moe": _MOE, "olmoe": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 64},
    "granitemoe": {**_MOE, "logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 4.0,
                   "residual_multiplier": 0.5, "attention_bias": False},
    "granite": {"logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 4.0,
                "residual_multiplier": 0.5, "attention_bias": False, "mlp_bias": False},
    "helium": {"attention_bias": False, "mlp_bias": False},
    "ernie4_5": {"use_bias": False},
    "glm4": {"attention_bias": False, "partial_rotary_factor": 0.5},
    "stablelm": {"use_qkv_bias": False, "partial_rotary_factor": 0.5},
    "gpt_neox": {"rotary_emb_base": 10000.0, "rotary_pct": 0.5},
    "gpt_bigcode": {},
    "minicpm": {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 4.0},
    "gemma2": {"num_hidden_layers": 2, "query_pre_attn_scalar": 16, "sliding_window": 8,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"num_hidden_layers": 3, "sliding_window": 8, "sliding_window_pattern": 3,
                    "query_pre_attn_scalar": 16},
    "cohere2": {"num_hidden_layers": 3, "sliding_window": 8, "sliding_window_pattern": 3},
    "olmo3": {"num_hidden_layers": 2, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"]},
    "exaone4": {"num_hidden_layers": 2, "sliding_window": 8, "sliding_window_pattern": "LG"},
    "ministral3": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                   "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 512}},
    "gpt_oss": {**_MOE, "num_hidden_layers": 2, "sliding_window": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v2": {**_MOE, **_MLA, "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy",
                    "num_key_value_heads": 4},
    "deepseek_v3": {**_MOE, **_MLA, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "num_key_value_heads": 4},
    "minicpm3": {**_MLA, "dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 4.0, "num_key_value_heads": 4},
    "llama4_text": {**_MOE, "num_hidden_layers": 4, "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
                    "use_qk_norm": True, "attention_chunk_size": 8, "interleave_moe_layer_step": 1},
    "llama4": {"text_config": {**_MOE, "num_experts_per_tok": 1, "model_type": "llama4_text", "hidden_size": 64, "num_attention_heads": 4,
                               "num_hidden_layers": 4, "vocab_size": 256, "intermediate_size": 128,
                               "intermediate_size_mlp": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                               "rope_theta": 10000.0, "head_dim": 16, "tie_word_embeddings": False,
                               "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True, "attention_chunk_size": 8,
                               "interleave_moe_layer_step": 1, "max_position_embeddings": 512, "attention_bias": False,
                               "rope_scaling": None,
                               "attn_temperature_tuning": False, "floor_scale": 8192, "attn_scale": 0.1}},
    "mamba": {**_MAMBA, "tie_word_embeddings": True},
    "mamba2": {**_MAMBA, "tie_word_embeddings": True},
    "qwen3_next": {**_MOE, "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "shared_expert_intermediate_size": 64, "partial_rotary_factor": 0.5},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3,
                         "attention_bias": False, "embedding_multiplier": 4.0, "attention_multiplier": 0.25,
                         "logits_scaling": 2.0, "residual_multiplier": 0.5, "mamba_n_heads": 4, "mamba_d_head": 32,
                         "mamba_proj_bias": False, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "shared_intermediate_size": 128, "num_local_experts": 4,
                         "num_experts_per_tok": 2},
    "lfm2": {"num_hidden_layers": 3, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
             "block_ff_dim": 128, "full_attn_idxs": [1]},
    "jamba": {**_MOE, "num_hidden_layers": 4, "attn_layer_offset": 1, "attn_layer_period": 2,
              "expert_layer_offset": 1, "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8,
              "mamba_expand": 2},
    "recurrent_gemma": {"num_hidden_layers": 3, "attention_bias": False, "conv1d_width": 4,
                        "logits_soft_cap": 30.0, "attention_window_size": 8,
                        "block_types": ["recurrent", "recurrent", "attention"], "num_key_value_heads": 1},
    "falcon_h1": {},
    "bailing_moe_v3": {}, "glm4_moe_lite": {}, "iquestloopcoder": {"loop_window_size": 8},
    "muse_glimmer": {}, "plamo2": {}, "plamo3": {"window_size": 8}, "qwen2_vl": {}, "qwen3_vl": {},
    "glm4_moe": {**_MOE, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                 "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": False,
                 "partial_rotary_factor": 0.5},
    "dbrx": {"d_model": 64, "n_layers": 2, "n_heads": 4,
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "nemotron_h": {"hybrid_override_pattern": "M*-", "num_hidden_layers": 3, "attention_bias": False,
                   "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 8,
                   "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
                   "time_step_limit": [0.0, float("inf")]},
    "ernie4_5_moe": {"use_bias": False, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                     "moe_layer_start_index": 1, "moe_num_shared_experts": 1},
    "hunyuan": {**_MOE, "attention_bias": False, "moe_topk": 2, "num_shared_expert": 1, "use_mixed_mlp_moe": True,
                "use_qk_norm": True, "use_cla": True, "cla_share_factor": 2,
                "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "minimax": {**_MOE, "shared_intermediate_size": 0, "rotary_dim": 8},
    "olmo_hybrid": {"num_hidden_layers": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                    "linear_allow_neg_eigval": True, "attention_bias": False,
                    "layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {**_MOE, "num_hidden_layers": 3, "use_expert_bias": True, "num_dense_layers": 1,
                 "conv_bias": False, "conv_L_cache": 3, "full_attn_idxs": [1]},
    "kimi_linear": {**_MOE, **_MLA, "num_hidden_layers": 2, "model_max_length": 512, "num_experts_per_token": 2,
                    "num_shared_experts": 1, "first_k_dense_replace": 1,
                    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4}},
    "rwkv7": {"head_dim": 16, "a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8,
              "decay_low_rank_dim": 8},
    "baichuan_m1": {"sliding_window": 8, "sliding_window_layers": [0], "conv_window": 2},
    "bailing_moe": {**_MOE, "num_shared_experts": 1, "first_k_dense_replace": 1, "topk_group": 1},
    "dots1": {**_MOE, "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0},
    "exaone_moe": {**_MOE, "num_shared_experts": 1, "sliding_window": 8,
                   "layer_types": ["sliding_attention", "full_attention"], "is_moe_layer": [False, True]},
    "openelm": {"num_transformer_layers": 2, "model_dim": 64, "ffn_dim_divisor": 16, "num_query_heads": [4, 4],
                "num_kv_heads": [2, 2], "ffn_multipliers": [2.0, 2.0]},
    "phi3small": {"dense_attention_every_n_layers": 2, "ff_intermediate_size": 128, "gegelu_limit": 20.0,
                  "blocksparse_block_size": 32, "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 2},
    "gptj": {"rotary_dim": 8},
    "qwen": {"kv_channels": 16, "intermediate_size": 256},
    "plamo": {"n_shared_head": 2},
    "step3p5": {"num_attention_groups": 2, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32,
                "moe_layers_enum": "1"},
    "Klear": {**_MOE, "attention_bias": False, "n_shared_experts": 1},
    "afm7": {"hidden_dim": 64, "num_layers": 3, "num_kv_reuse_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    "afmoe": {**_MOE, "num_hidden_layers": 2, "num_dense_layers": 1, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"]},
    "apertus": {"mlp_bias": False, "attention_bias": False, "post_norm": False, "qk_norm": True},
    "bailing_moe_linear": {**_MOE, "num_shared_experts": 1, "first_k_dense_replace": 1, "layer_group_size": 2,
                           "group_norm_size": 1, "topk_group": 1},
    "mellum": {**_MOE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "mistral4": {**_MOE, **_MLA, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "llama_4_scaling_beta": 0.1,
                                                     "original_max_position_embeddings": 512},
                 "n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_group": 1,
                 "first_k_dense_replace": 1, "n_group": 1, "num_key_value_heads": 4},
    "solar_open": {**_MOE, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                   "partial_rotary_factor": 0.5},
    "spark2_5": {"hidden_act": "gelu", "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gear": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
             "query_pre_attn_scalar": 16},
    "lille-130m": {"block_size": 512, "n_kv_heads": 2},
    "qwen3_5": {"num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "qwen3_5_moe": {**_MOE, "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_value_heads": 4,
                    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "shared_expert_intermediate_size": 64},
    "gemma4_text": {"num_hidden_layers": 4, "global_head_dim": 16, "vocab_size_per_layer_input": 256,
                    "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2, "sliding_window": 8,
                    "sliding_window_pattern": 2, "num_key_value_heads": 2, "use_double_wide_mlp": False},
    "glm_moe_dsa": {**_MOE, **_MLA, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "moe_layer_freq": 1,
                    "first_k_dense_replace": 1, "attention_bias": False, "num_key_value_heads": 4,
                    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "longcat_flash": {**_MLA, "attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 128,
                      "moe_topk": 2, "expert_ffn_hidden_size": 32, "n_routed_experts": 4, "zero_expert_num": 1,
                      "num_layers": 2, "routed_scaling_factor": 1.0, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True, "attention_bias": False},
    "mimo_v2_flash": {**_MOE, "hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 8, "n_shared_experts": None, "routed_scaling_factor": 1.0,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1,
                      "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16,
                      "partial_rotary_factor": 0.5},
    "longcat_flash_ngram": {**_MLA, "ffn_hidden_size": 128, "moe_topk": 2, "expert_ffn_hidden_size": 32,
                            "n_routed_experts": 4, "zero_expert_num": 1, "num_layers": 2, "routed_scaling_factor": 1.0,
                            "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "ngram_vocab_size_ratio": 2},
    "kimi_k3": {**_MOE, **_MLA, "hidden_act": "situ", "num_experts_per_token": 2, "num_shared_experts": 1,
                "first_k_dense_replace": 1, "num_key_value_heads": 4,
                "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                       "head_dim": 16, "short_conv_kernel_size": 4}},
    "nemotron-nas": {"block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}}]},
    "deepseek_v41": {"qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "sliding_window": 8, "index_n_heads": 2,
                     "index_head_dim": 16, "index_topk": 4, "hc_mult": 2, "candidate_block_size": 4,
                     "candidate_topk_blocks": 4},
    "deepseek_v32": {**_MOE, **_MLA, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1, "num_key_value_heads": 4, "index_head_dim": 16, "index_n_heads": 2,
                     "index_topk": 4},
    "phixtral": {"num_vocab": 256, "model_dim": 64, "num_heads": 4, "num_layers": 2, "rotary_dim": 8},
    "bailing_hybrid": {**_MOE, **_MLA, "num_hidden_layers": 4, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
                       "first_k_dense_replace": 1, "layer_group_size": 2, "group_norm_size": 1,
                       "routed_scaling_factor": 1.0, "num_key_value_heads": 4},
    # Refused (tests/engine/test_architectures.py REFUSED): Metal-only kernels, a missing package.
    "bitnet": {},
    "olmo": {"d_model": 64, "n_layers": 2, "mlp_hidden_size": 256, "n_heads": 4, "embedding_size": 256},
}
FAMILIES["gemma3n"] = {"text_config": {
    **_BASE, "model_type": "gemma3n_text", "num_hidden_layers": 4, "num_kv_shared_layers": 2,
    "vocab_size_per_layer_input": 256, "sliding_window": 8, "rope_local_base_freq": 10000.0,
    "final_logit_softcapping": None, "activation_sparsity_pattern": [0.0] * 4, "hidden_size_per_layer_input": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "altup_num_inputs": 2, "altup_coef_clip": 120.0,
    "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8}}

FAMILIES["minimax_m3_vl"] = {"text_config": {
    **_BASE, "model_type": "minimax_m3", "intermediate_size": 32, "dense_intermediate_size": 128,
    "shared_intermediate_size": 32, "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0, "mlp_layer_types": ["dense", "sparse", "sparse"],
    # block-sparse attention: 4-key blocks, 2 kept (one local) once a context passes 8 keys
    "layer_types": ["full_attention", "sparse_attention", "sparse_attention"], "index_n_heads": 2,
    "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1}}
FAMILIES["muse_spark"] = {"text_config": {
    **_BASE, "num_hidden_layers": 3, "post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0},
    "layer_rope_theta": [10000.0, 10000.0, 0], "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 8, "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "num_local_experts": 4,
    "num_experts_per_tok": 2, "moe_hidden_size": 32, "moe_intermediate_size": 32}}
# A 2-bit Hadamard pack of qwen3_5: the down projections (width 512) are packed and rotated.
FAMILIES["prism_hadamard_qwen35"] = {
    "text_config": {**_BASE, **FAMILIES["qwen3_5"], "model_type": "qwen3_5", "intermediate_size": 512},
    "schema_version": 1, "tensor_namespace": "mlx-lm-text", "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
    "modules": [{"path": f"model.layers.{i}.mlp.down_proj", "embedding": False, "dtype": "float16", "block": 512}
                for i in range(4)]}

# Multimodal wrappers mlx-lm serves as text models: a text_config of the inner family.
_WRAPPERS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "mistral3": "llama", "pixtral": "llama", "kimi_vl": "deepseek_v3",
             "qwen3_vl_moe": "qwen3_moe", "lfm2-vl": "lfm2", "kimi_k25": "deepseek_v3"}
FAMILIES.update({w: {"text_config": {**_BASE, **FAMILIES[inner], "model_type": inner}}
                 for w, inner in _WRAPPERS.items()})


def tiny_config(family: str) -> dict[str, Any]:
    return {**_BASE, **FAMILIES[family], "model_type": family}


def build(family: str, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """(model, config): the family's mlx-lm Model with deterministic random float32 weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = tiny_config(family)
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    model = mod.Model(mod.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    weights = [(k, _param(k, v, config, seed)) for k, v in sorted(params.items())]
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model, config


def _param(name: str, like: Any, config: dict[str, Any], seed: int) -> Any:
    """One random parameter of `like`'s shape and dtype. Packed (already quantized) layers hold
    integer words, float16 scales and sign vectors: each gets values of its own kind."""
    import mlx.core as mx
    import numpy as np

    if not like.shape:  # 0-d parameters (learned activation constants)
        return mx.array(np.float32(0.5))
    if name.endswith(".signs"):  # Hadamard sign vectors: +-1
        return mx.array(np.sign(init_tensor(name, like.shape, config, seed) + 1e-9).astype(np.float32)).astype(like.dtype)
    if mx.issubdtype(like.dtype, mx.integer):  # packed weight words: uniform bits
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        return mx.array(rng.integers(0, 2**32, like.shape, dtype=np.uint64).astype(np.uint32)).astype(like.dtype)
    out = init_tensor(name, like.shape, config, seed)
    if name.endswith((".scales", ".biases")):  # dequantized weights of O(1 / sqrt(fan-in)) magnitude
        out = out * np.float32(0.05)
    return mx.array(out) if like.dtype == mx.float32 else mx.array(out).astype(like.dtype)


def write(family: str, dest: Path, seed: int = 0) -> Path:
    """Write the family's tiny model as an mlx-lm model directory (config.json + weights) at `dest`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if (dest / "config.json").is_file():
        return dest
    try:
        model, config = build(family, seed)
        weights = dict(tree_flatten(model.parameters()))
    except SystemExit:  # its module exits on import (olmo without ai2-olmo): the config, a stub tensor
        config, weights = tiny_config(family), {"stub": mx.zeros((1,))}
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))  # written last: marks it complete
    return dest


# Built-ins (builtin:<name>, with the trained tokenizer) of the families whose layers differ most.
BUILTIN_FAMILIES = {"tiny-gemma3": "gemma3_text", "tiny-gpt-oss": "gpt_oss", "tiny-deepseek-v3": "deepseek_v3",
                    "tiny-granitemoehybrid": "granitemoehybrid", "tiny-mamba2": "mamba2"}


_BUILTIN_CORE = {"vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
                  "rms_norm_eps", "hidden_act"}


def builtin_specs(base: Any) -> dict[str, Any]:
    """BuiltinSpecs (`base` with the family's overrides) for sidecar.models.builtin."""
    out = {}
    for name, family in BUILTIN_FAMILIES.items():
        # The built-in config has the core keys; the base's other names and the family's keys join it.
        extra = {**{k: v for k, v in _BASE.items() if k not in _BUILTIN_CORE}, **FAMILIES[family]}
        out[name] = replace(base, model_type=family, num_layers=int(extra.get("num_hidden_layers", base.num_layers)),
                            tie_word_embeddings=bool(extra.get("tie_word_embeddings", base.tie_word_embeddings)),
                            extra_config=extra)
    return out
