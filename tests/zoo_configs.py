"""Tiny configs for every mlx-lm text architecture (the "zoo").

Each entry of :data:`ZOO` is a config.json-style dict that
``specdec_cli.session.synthetic.build_model`` turns into a random-weight model:
hidden size 32-64, 2-4 layers, a few heads, vocab 259 (the synthetic byte
tokenizer), small expert counts, and sliding windows of 8 so that windows are
shorter than the ~80-token sequences the zoo check generates. Layer patterns
include every layer kind an architecture has (sliding + full attention,
recurrent + attention, dense + MoE, ...).

mlx-lm's ``BaseModelArgs.from_dict`` drops unknown keys, so every entry starts
from the shared :data:`_BASE` fields and overrides what its ModelArgs needs.

Architectures that could not be built are listed in :data:`UNBUILDABLE`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

VOCAB = 259  # specdec_cli.session.synthetic.VOCAB_SIZE
W = 8  # sliding window / chunk size: shorter than the test sequences

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}

# MoE fields under their various spellings (ignored by dense models).
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}

# Multi-head latent attention (DeepSeek-style) fields.
_MLA: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}


def _c(model_type: str, *extra: dict[str, Any], **kw: Any) -> dict[str, Any]:
    cfg = {**_BASE}
    for e in extra:
        cfg.update(e)
    cfg.update(kw)
    cfg["model_type"] = model_type
    return cfg


def _text(model_type: str, text: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """A wrapper config (vision-language shell) around a text_config."""
    return {"model_type": model_type, "vocab_size": VOCAB, "text_config": text, **kw}


_SWA2 = ["sliding_attention", "full_attention"]

ZOO: dict[str, dict[str, Any]] = {
    # ----- dense llama-likes -------------------------------------------------
    "llama": _c("llama", num_hidden_layers=2, layer_types=_SWA2, sliding_window=W),
    "apertus": _c("apertus", post_norm=False, qk_norm=True),
    "bitnet": _c("bitnet"),
    "cohere": _c("cohere", layer_norm_eps=1e-5, use_qk_norm=True),
    "cohere2": _c("cohere2", num_hidden_layers=4, sliding_window=W, sliding_window_pattern=2),
    "ernie4_5": _c("ernie4_5", use_bias=False),
    "exaone": _c("exaone", num_layers=2),
    "exaone4": _c(
        "exaone4",
        num_hidden_layers=2,
        rope_scaling=None,
        sliding_window=W,
        sliding_window_pattern="LG",
    ),
    "gemma": _c("gemma"),
    "gemma2": _c("gemma2", query_pre_attn_scalar=16.0),
    "gemma3_text": _c(
        "gemma3_text",
        num_hidden_layers=4,
        query_pre_attn_scalar=16,
        sliding_window=W,
        sliding_window_pattern=2,
        rope_local_base_freq=10000.0,
    ),
    "glm": _c("glm"),
    "glm4": _c("glm4", partial_rotary_factor=0.5),
    "gpt2": _c("gpt2", n_ctx=4096, n_embd=64, n_head=4, n_layer=2, n_positions=4096),
    "gpt_bigcode": _c("gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=4096),
    "gpt_neox": _c("gpt_neox", rotary_emb_base=10000, rotary_pct=0.5),
    "gptj": _c("gptj", n_embd=64, n_head=4, rotary_dim=8, n_layer=2, n_positions=4096),
    "granite": _c(
        "granite",
        logits_scaling=2.0,
        attention_multiplier=0.25,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
    ),
    "helium": _c("helium"),
    "hunyuan_v1_dense": _c("hunyuan_v1_dense"),
    "internlm2": _c("internlm2", bias=False),
    "internlm3": _c("internlm3"),
    "iquestloopcoder": _c("iquestloopcoder", loop_num=2, loop_window_size=W),
    "lille-130m": _c("lille-130m", block_size=4096, n_embd=64, n_head=4, n_kv_heads=2, n_layer=2),
    "mimo": _c("mimo", num_nextn_predict_layers=0),
    "minicpm": _c("minicpm", dim_model_base=32, scale_depth=1.4, scale_emb=2.0),
    "ministral3": _c(
        "ministral3",
        layer_types=_SWA2,
        sliding_window=W,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 16,
        },
    ),
    "nanbeige": _c("nanbeige", num_loops=2),
    "nanochat": _c("nanochat", num_key_value_heads=4),
    "nemotron": _c("nemotron", hidden_act="relu2", partial_rotary_factor=0.5),
    "olmo": _c(
        "olmo",
        d_model=64,
        n_layers=2,
        mlp_hidden_size=128,
        n_heads=4,
        embedding_size=VOCAB,
    ),
    "olmo2": _c("olmo2"),
    "olmo3": _c("olmo3", num_hidden_layers=2, sliding_window=W, layer_types=_SWA2),
    "openelm": _c(
        "openelm",
        num_transformer_layers=2,
        model_dim=64,
        ffn_dim_divisor=16,
        num_query_heads=[4, 4],
        num_kv_heads=[2, 2],
        ffn_multipliers=[1.0, 2.0],
    ),
    "phi": _c("phi", num_key_value_heads=4, partial_rotary_factor=0.5),
    "phi3": _c("phi3"),
    # Model.__call__ writes -inf into fixed dummy token ids 100256..100351
    # (phi3small.py:295), out of bounds (heap corruption) for a smaller vocab.
    "phi3small": _c(
        "phi3small",
        vocab_size=100352,
        # The default 10x embedding gain makes a random model repeat its input
        # token forever; 0.1 gives varied output.
        mup_embedding_multiplier=0.1,
        num_hidden_layers=2,
        dense_attention_every_n_layers=2,
        ff_intermediate_size=128,
        gegelu_limit=20.0,
        blocksparse_block_size=32,
        blocksparse_num_local_blocks=1,
        blocksparse_vert_stride=2,
    ),
    "plamo": _c("plamo", n_shared_head=2),
    "qwen": _c("qwen", kv_channels=16, no_bias=True, num_key_value_heads=4),
    "qwen2": _c("qwen2"),
    "qwen3": _c("qwen3"),
    "seed_oss": _c("seed_oss"),
    "smollm3": _c("smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    "stablelm": _c("stablelm", use_qkv_bias=True, partial_rotary_factor=0.5, qk_layernorm=True),
    "starcoder2": _c("starcoder2", norm_epsilon=1e-5),
    "talkie": _c("talkie", num_key_value_heads=4),
    "telechat3": _c("telechat3"),
    "youtu_llm": _c("youtu_llm", _MLA),
    "minicpm3": _c(
        "minicpm3", _MLA, rope_scaling={"original_max_position_embeddings": 4096, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}, dim_model_base=32, scale_depth=1.4, scale_emb=2.0, num_key_value_heads=4
    ),
    "afm7": _c(
        "afm7", hidden_dim=64, num_layers=3, num_kv_reuse_layers=1, num_heads=4, num_kv_heads=2
    ),
    "nemotron-nas": _c(
        "nemotron-nas",
        num_hidden_layers=3,
        block_configs=[
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
        ],
    ),
    "muse_glimmer": _c(
        "muse_glimmer",
        num_hidden_layers=2,
        sliding_window=W,
        layer_types=_SWA2,
    ),
    "spark2_5": _c(
        "spark2_5",
        num_hidden_layers=2,
        sliding_window=W,
        layer_types=_SWA2,
        rope_parameters={
            "sliding_attention": {"rope_theta": 10000.0},
            "full_attention": {"rope_theta": 100000.0, "partial_rotary_factor": 0.5},
        },
    ),
    "plamo3": _c("plamo3", num_hidden_layers=2, sliding_window=W, sliding_window_pattern=2),
    "gemma4_text": _c(
        "gemma4_text",
        num_hidden_layers=4,
        head_dim=16,
        global_head_dim=32,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        sliding_window=W,
        sliding_window_pattern=2,
        final_logit_softcapping=30.0,
        use_double_wide_mlp=True,
    ),
    "gemma3n": _text(
        "gemma3n",
        _c(
            "gemma3n_text",
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=VOCAB,
            sliding_window=W,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0,
            layer_types=_SWA2 * 2,
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
            hidden_size_per_layer_input=8,
            altup_num_inputs=2,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=8,
        ),
    ),
    # ----- sliding window / chunked -------------------------------------------
    "gpt_oss": _c(
        "gpt_oss", _MOE, num_hidden_layers=2, sliding_window=W, layer_types=_SWA2
    ),
    "mellum": _c(
        "mellum",
        _MOE,
        num_hidden_layers=2,
        sliding_window=W,
        layer_types=_SWA2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "step3p5": _c(
        "step3p5",
        num_hidden_layers=2,
        num_attention_groups=2,
        sliding_window=W,
        layer_types=_SWA2,
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=32,
        share_expert_dim=32,
    ),
    "laguna": _c(
        "laguna",
        _MOE,
        num_hidden_layers=2,
        sliding_window=W,
        layer_types=_SWA2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "afmoe": _c(
        "afmoe",
        _MOE,
        num_hidden_layers=3,
        num_dense_layers=1,
        sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "exaone_moe": _c(
        "exaone_moe",
        _MOE,
        num_hidden_layers=2,
        sliding_window=W,
        layer_types=_SWA2,
        is_moe_layer=[False, True],
    ),
    "mimo_v2_flash": _c(
        "mimo_v2_flash",
        _MOE,
        num_hidden_layers=2,
        hybrid_layer_pattern=[1, 0],
        moe_layer_freq=[0, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=W,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        layernorm_epsilon=1e-5,
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        v_head_dim=16,
        swa_head_dim=16,
        swa_v_head_dim=16,
        partial_rotary_factor=0.5,
    ),
    "llama4": _text(
        "llama4",
        _c(
            "llama4_text",
            _MOE,
            num_hidden_layers=4,
            attention_chunk_size=W,
            interleave_moe_layer_step=2, num_experts_per_tok=1,
            intermediate_size_mlp=128,
            rope_scaling=None,
            use_qk_norm=True,
        ),
    ),
    "llama4_text": _c(
        "llama4_text",
        _MOE,
        num_hidden_layers=4,
        intermediate_size_mlp=128,
        no_rope_layers=[1, 1, 1, 0],
        use_qk_norm=True,
    ),
    # ----- MoE ---------------------------------------------------------------
    "mixtral": _c("mixtral", _MOE),
    "phimoe": _c("phimoe", _MOE),
    "phixtral": _c(
        "phixtral", num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "olmoe": _c("olmoe", _MOE),
    "qwen2_moe": _c("qwen2_moe", _MOE),
    "qwen3_moe": _c("qwen3_moe", _MOE),
    "Klear": _c("Klear", _MOE),
    "granitemoe": _c(
        "granitemoe",
        _MOE,
        logits_scaling=2.0,
        attention_multiplier=0.25,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
    ),
    "minimax": _c("minimax", _MOE, shared_intermediate_size=32, rotary_dim=8),
    "dbrx": _c(
        "dbrx",
        d_model=64,
        n_layers=2,
        n_heads=4,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "deepseek": _c("deepseek", _MOE, num_key_value_heads=4),
    "deepseek_v2": _c(
        "deepseek_v2", _MOE, _MLA, num_key_value_heads=4, topk_method="greedy",
        rope_scaling={"factor": 1.0, "mscale_all_dim": 0, "original_max_position_embeddings": 4096}
    ),
    "deepseek_v3": _c("deepseek_v3", _MOE, _MLA, num_key_value_heads=4),
    "deepseek_v32": _c(
        "deepseek_v32", _MOE, _MLA, num_key_value_heads=4,
        index_head_dim=16, index_n_heads=2, index_topk=4,
    ),
    "glm_moe_dsa": _c(
        "glm_moe_dsa", _MOE, _MLA, num_key_value_heads=4,
        index_head_dim=16, index_n_heads=2, index_topk=4,
        topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "kimi_vl": _text("kimi_vl", _c("deepseek_v3", _MOE, _MLA, num_key_value_heads=4)),
    "kimi_k25": _text("kimi_k25", _c("deepseek_v3", _MOE, _MLA, num_key_value_heads=4)),
    "glm4_moe": _c(
        "glm4_moe", _MOE, rope_scaling=None, use_qk_norm=True, partial_rotary_factor=0.5
    ),
    "glm4_moe_lite": _c("glm4_moe_lite", _MOE, _MLA, num_key_value_heads=4, num_nextn_predict_layers=0),
    "solar_open": _c("solar_open", _MOE, partial_rotary_factor=0.5),
    "dots1": _c("dots1", _MOE, scoring_func="noaux_tc"),
    "ernie4_5_moe": _c(
        "ernie4_5_moe", _MOE, use_bias=False, moe_layer_start_index=1, moe_num_shared_experts=1
    ),
    "bailing_moe": _c("bailing_moe", _MOE),
    "hunyuan": _c(
        "hunyuan", _MOE, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
        use_cla=True, cla_share_factor=2, rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    ),
    "mistral4": _c("mistral4", _MOE, _MLA, num_key_value_heads=4,
        rope_parameters={"factor": 1.0, "mscale_all_dim": 0, "original_max_position_embeddings": 4096,
                      "rope_type": "yarn", "llama_4_scaling_beta": 0.1}),
    "longcat_flash": _c(
        "longcat_flash", _MLA,
        attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=128,
        moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
        num_layers=2, mla_scale_q_lora=True, mla_scale_kv_lora=True, routed_scaling_factor=1.0,
    ),
    "longcat_flash_ngram": _c(
        "longcat_flash_ngram", _MLA,
        ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4,
        zero_expert_num=2, num_layers=2, mla_scale_q_lora=True, mla_scale_kv_lora=True,
        routed_scaling_factor=1.0, ngram_vocab_size_ratio=2, emb_neighbor_num=2, emb_split_num=2,
    ),
    "minimax_m3_vl": _text(
        "minimax_m3_vl",
        _c(
            "minimax_m3", _MOE, num_hidden_layers=2, dense_intermediate_size=128,
            shared_intermediate_size=32, head_dim=16, rotary_dim=8,
            mlp_layer_types=["dense", "sparse"],
            # Layer 1 uses the block-sparse indexer (a second KV cache).
            layer_types=["full_attention", "sparse_attention"],
            index_n_heads=2, index_head_dim=16, index_block_size=4,
            index_topk_blocks=3, index_local_blocks=1,
        ),
    ),
    "muse_spark": _text(
        "muse_spark",
        _c(
            "muse_spark_text", _MOE, num_hidden_layers=2, post_norm_eps=1e-8,
            rope_parameters={"rope_theta": 10000.0}, layer_rope_theta=[10000.0, 0],
            layer_types=_SWA2, sliding_window=W, final_logit_softcapping=20.0,
            output_multiplier=0.2, moe_hidden_size=64, num_shared_experts=0,
            mlp_layer_types=None,
        ),
    ),
    # ----- recurrent / hybrid ------------------------------------------------
    "mamba": _c(
        "mamba", state_size=8, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=4, intermediate_size=128,
    ),
    "mamba2": _c(
        "mamba2", num_heads=8, head_dim=16, state_size=16, conv_kernel=4, n_groups=2,
        use_bias=False, use_conv_bias=True, time_step_limit=(0.0, float("inf")),
        time_step_rank=4,
    ),
    "rwkv7": _c(
        "rwkv7", head_dim=16, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    ),
    "recurrent_gemma": _c(
        "recurrent_gemma", num_hidden_layers=3, conv1d_width=4, logits_soft_cap=30.0,
        attention_window_size=W, block_types=["recurrent", "recurrent", "attention"],
        num_key_value_heads=1,
    ),
    "jamba": _c(
        "jamba", _MOE, num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8,
        mamba_expand=2,
    ),
    "falcon_h1": _c(
        "falcon_h1", num_hidden_layers=2, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64,
        mamba_d_state=16, mamba_n_groups=1, mamba_n_heads=4, mamba_chunk_size=8,
        embedding_multiplier=1.0, lm_head_multiplier=1.0,
    ),
    "nemotron_h": _c(
        "nemotron_h", _MOE, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=2, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern="M*-E", num_hidden_layers=4,
        moe_shared_expert_intermediate_size=32,
    ),
    "granitemoehybrid": _c(
        "granitemoehybrid", _MOE, num_hidden_layers=2, embedding_multiplier=2.0,
        attention_multiplier=0.25, logits_scaling=2.0, residual_multiplier=0.5,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
        mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
        mamba_conv_bias=True, shared_intermediate_size=32,
    ),
    "plamo2": _c(
        "plamo2", num_hidden_layers=2, hidden_size_per_head=16, attention_window_size=W,
        mamba_d_state=8, mamba_d_conv=4, mamba_num_heads=4, mamba_step=2,
        mamba_chunk_size=8, tie_word_embeddings=True,
    ),
    "lfm2": _c(
        "lfm2", num_hidden_layers=2, conv_bias=False, conv_L_cache=3, block_dim=64,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention"],
    ),
    "lfm2_moe": _c(
        "lfm2_moe", _MOE, num_hidden_layers=2, use_expert_bias=True, num_dense_layers=1,
        conv_bias=False, conv_L_cache=3, layer_types=["conv", "full_attention"],
    ),
    "lfm2-vl": _text(
        "lfm2-vl",
        _c(
            "lfm2", num_hidden_layers=2, conv_bias=False, conv_L_cache=3, block_dim=64,
            block_multiple_of=16, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"],
        ),
    ),
    "gear": _c(
        "gear", num_hidden_layers=3, sliding_window=W,
        layer_types=["sliding_attention", "conv_mixer", "full_attention"],
    ),
    "baichuan_m1": _c(
        "baichuan_m1", num_hidden_layers=2, sliding_window=W, sliding_window_layers=[0],
        conv_window=2,
    ),
    "qwen3_next": _c(
        "qwen3_next", _MOE, num_hidden_layers=2, full_attention_interval=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.5,
        mlp_only_layers=[],
    ),
    "qwen3_5": _text(
        "qwen3_5",
        _c(
            "qwen3_5_text", num_hidden_layers=4, full_attention_interval=2,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters={
                "type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    "qwen3_5_moe": _text(
        "qwen3_5_moe",
        _c(
            "qwen3_5_moe_text", _MOE, num_hidden_layers=2, full_attention_interval=2,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, mlp_only_layers=[],
            rope_parameters={
                "type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    "olmo_hybrid": _c(
        "olmo_hybrid", num_hidden_layers=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        layer_types=["linear_attention", "full_attention"],
    ),
    "kimi_linear": _c(
        "kimi_linear", _MOE, _MLA, num_hidden_layers=2, num_key_value_heads=4,
        model_max_length=4096, num_experts_per_token=2,
        linear_attn_config={
            "kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    ),
    "bailing_moe_linear": _c(
        "bailing_moe_linear", _MOE, num_hidden_layers=2, layer_group_size=2,
        group_norm_size=1,
    ),
    "bailing_hybrid": _c(
        "bailing_hybrid", _MOE, _MLA, num_hidden_layers=2, layer_group_size=2,
        group_norm_size=1, head_dim=16,
    ),
    "bailing_moe_v3": _c(
        "bailing_moe_v3", _MOE, _MLA, num_hidden_layers=2, layer_group_size=2, head_dim=16,
        short_conv_kernel_size=4,
    ),
    "kimi_k3": _text(
        "kimi_k3",
        _c(
            "kimi_linear", _MOE, _MLA, num_hidden_layers=2, num_key_value_heads=4,
            num_experts_per_token=2,
            linear_attn_config={
                "kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        ),
    ),
    "deepseek_v41": _c(
        "deepseek_v41", _MOE, num_hidden_layers=2, head_dim=32, q_lora_rank=32,
        qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=W,
        compress_ratios=(0, 4), kv_source_layer_ids=(1,), index_source_layer_ids=(1,),
        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2, hc_sinkhorn_iters=3,
        rms_norm_eps=1e-6,
    ),
}

# Vision/text wrappers whose text_config names another architecture.
ZOO.update(
    {
        "gemma3": _text("gemma3", {**ZOO["gemma3_text"], "model_type": "gemma3_text"}),
        "gemma4": _text("gemma4", {**ZOO["gemma4_text"], "model_type": "gemma4_text"}),
        "mistral3": _text("mistral3", {**ZOO["ministral3"]}),
        "pixtral": _text("pixtral", _c("llama")),
        "qwen2_vl": _text("qwen2_vl", _c("qwen2", rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})),
        # A 2-bit Hadamard-rotated pack of qwen3_5: one packed linear (zero
        # weights) is enough to exercise the code path; caches are qwen3_5's.
        "prism_hadamard_qwen35": _text(
            "prism_hadamard_qwen35",
            {**ZOO["qwen3_5"]["text_config"]},
            schema_version=1,
            tensor_namespace="mlx-lm-text",
            quantization={"bits": 2, "group_size": 128, "mode": "affine"},
            modules=[
                {"path": "model.layers.0.mlp.down_proj", "embedding": False,
                 "dtype": "float16", "block": 0},
            ],
        ),
        "qwen3_vl": _text(
            "qwen3_vl",
            _c("qwen3_vl_text", rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]}),
        ),
        "qwen3_vl_moe": _text(
            "qwen3_vl_moe",
            _c(
                "qwen3_vl_moe_text", _MOE, mlp_only_layers=[],
                rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]},
            ),
        ),
    }
)

UNBUILDABLE: dict[str, str] = {
    "bitnet": "BitLinear runs a custom Metal kernel (bitlinear_layers.py:130 "
    "mx.fast.metal_kernel); this MLX build has the CPU backend only",
    "muse_spark": "the attention calls the Metal-only kernels in mlx_lm/kernels "
    "(qk_norm_rope.py:83); this MLX build has the CPU backend only",
    "olmo": "any multi-token forward fails in stock mlx-lm: create_attention_mask "
    "returns the string 'causal' and olmo.py:93 does `scores += mask` "
    "(ValueError: inplace addition on array and str)",
}


def install_import_stubs() -> None:
    """Stub optional imports that some model files probe but never use.

    ``mlx_lm/models/olmo.py`` calls ``sys.exit`` unless ``hf_olmo`` (package
    ai2-olmo, which pulls in torch) imports; the module is only an availability
    probe, so an empty stand-in lets the architecture build.
    """
    sys.modules.setdefault("hf_olmo", types.ModuleType("hf_olmo"))


# Configs kept for reference (e.g. a Metal build), out of the zoo proper.
UNBUILDABLE_CONFIGS: dict[str, dict[str, Any]] = {k: ZOO.pop(k) for k in UNBUILDABLE}
