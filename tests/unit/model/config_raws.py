"""Raw config.json dicts the model-config tests parse: the tiny checkpoint in its legacy and flat
spellings, MiniMax-M3.1-Flash's real config, and variants of them.
"""

from __future__ import annotations

from typing import Any


def tiny_legacy_text() -> dict[str, Any]:
    """Raw-checkpoint spelling (model-m3.md §G): nested sparse block, moe_layer_freq, flat rope."""
    return {
        "model_type": "minimax_m3",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "rope_theta": 5e6,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "moe_layer_freq": [0, 1, 1, 1],
        "dense_intermediate_size": 96,
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "n_shared_experts": 1,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.0,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "swiglu_beta": 1.0,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "use_gemma_norm": True,
        "attention_output_gate": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": 4,
            "sparse_topk_blocks": 3,
            "sparse_local_block": 1,
            "sparse_init_block": 0,
            "sparse_score_type": "max",
            "sparse_attention_freq": [1, 0, 1, 1],
            "sparse_disable_index_value": [1, 1, 1, 1],
        },
    }


def tiny_flat_text() -> dict[str, Any]:
    """HF's flat spelling of the same model."""
    return {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "partial_rotary_factor": 0.5,
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": [
            "minimax_m3_sparse",
            "full_attention",
            "minimax_m3_sparse",
            "minimax_m3_sparse",
        ],
        "dense_intermediate_size": 96,
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.0,
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_block_size": 4,
        "index_topk_blocks": 3,
        "index_local_blocks": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def real_m31_flash() -> dict[str, Any]:
    """Best reconstruction of the M3.1-Flash config.json (model-m3.md §A.2 / §A.3)."""
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16",
        "image_token_index": 200025,
        "video_token_index": 200026,
        "projector_hidden_size": 6144,
        "tie_word_embeddings": False,
        "vision_config": {"hidden_size": 1280, "num_hidden_layers": 32, "patch_size": 14},
        "text_config": {
            "model_type": "minimax_m3",
            "vocab_size": 200064,
            "hidden_size": 6144,
            "num_hidden_layers": 60,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "rotary_dim": 64,
            "partial_rotary_factor": 0.5,
            "rope_theta": 5_000_000,
            "rms_norm_eps": 1e-6,
            "intermediate_size": 3072,
            "shared_intermediate_size": 3072,
            "dense_intermediate_size": 12288,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.0,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "hidden_act": "swigluoai",
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "swiglu_beta": 1.0,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "use_gemma_norm": True,
            "attention_output_gate": False,
            "moe_layer_freq": [0, 0, 0] + [1] * 57,
            "bos_token_id": 200034,
            "eos_token_id": 200020,
            "sparse_attention_config": {
                "use_sparse_attention": True,
                "sparse_num_index_heads": 4,
                "sparse_index_dim": 128,
                "sparse_block_size": 128,
                "sparse_topk_blocks": 16,
                "sparse_local_block": 1,
                "sparse_init_block": 0,
                "sparse_score_type": "max",
                "sparse_attention_freq": [1] * 60,
                "sparse_disable_index_value": [1] * 60,
            },
        },
    }


def legacy_with(**changes: Any) -> dict[str, Any]:
    raw = tiny_legacy_text()
    raw.update(changes)
    return raw


def sparse_with(**changes: Any) -> dict[str, Any]:
    raw = tiny_legacy_text()
    raw["sparse_attention_config"].update(changes)
    return raw


def mixed_quant() -> dict[str, Any]:
    prefix = "language_model.model.layers.3"
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "modelopt", "version": "0.0"},
        "kv_cache_quant_algo": None,
        "quantized_layers": {
            f"{prefix}.self_attn.q_proj": {"quant_algo": "MXFP8"},
            f"{prefix}.self_attn.index_q_proj": {"quant_algo": "MXFP8"},
            f"{prefix}.block_sparse_moe.experts.0.w1": {"quant_algo": "NVFP4", "group_size": 16},
            f"{prefix}.block_sparse_moe.experts.0.w2": "NVFP4",
        },
        "exclude_modules": ["lm_head"],
    }
