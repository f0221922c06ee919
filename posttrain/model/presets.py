"""Named model shapes (no weights): published configurations of real models, and tiny ones for tests.

Sources: config.json on the Hugging Face hub of HuggingFaceTB/SmolLM2-135M-Instruct, Qwen/Qwen3-0.6B,
Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct."""
from __future__ import annotations

import dataclasses

from posttrain.model.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig

_DEEPSEEK_MLA = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="llama", vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        mlp_dim=1536, norm_eps=1e-5, rope=RopeConfig(theta=100000.0), max_position=8192, tie_embeddings=True),
    "qwen3-0.6b": ModelConfig(
        name="qwen3", vocab_size=151936, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        mlp_dim=3072, norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), max_position=40960, tie_embeddings=True,
        qk_norm=True, param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3_moe", vocab_size=151936, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, mlp_dim=6144, norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), max_position=40960,
        qk_norm=True, param_dtype="bfloat16", dtype="bfloat16", remat="full",
        moe=MoEConfig(num_experts=128, num_experts_per_tok=8, expert_mlp_dim=768, norm_topk_prob=True,
                      aux_loss_coef=0.001)),
    "deepseek-v3-671b": ModelConfig(
        name="deepseek_v3", vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=192, mlp_dim=18432, norm_eps=1e-6, max_position=163840, mla=_DEEPSEEK_MLA,
        rope=RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        param_dtype="bfloat16", dtype="bfloat16", remat="full",
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, expert_mlp_dim=2048, num_shared_experts=1,
                      scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=8,
                      topk_groups=4, first_k_dense=3, dense_mlp_dim=18432, score_bias=True, bias_update_rate=0.001)),
    "kimi-k2-1t": ModelConfig(
        name="kimi_k2", vocab_size=163840, d_model=7168, num_layers=61, num_heads=64, num_kv_heads=64,
        head_dim=192, mlp_dim=18432, norm_eps=1e-6, max_position=131072, mla=_DEEPSEEK_MLA,
        rope=RopeConfig(theta=50000.0, type="yarn", factor=32.0, original_max_position=4096, beta_fast=1.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        param_dtype="bfloat16", dtype="bfloat16", remat="full",
        moe=MoEConfig(num_experts=384, num_experts_per_tok=8, expert_mlp_dim=2048, num_shared_experts=1,
                      scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827, first_k_dense=1,
                      dense_mlp_dim=18432, score_bias=True, bias_update_rate=0.001)),
    # ---- tiny shapes for tests (seconds on a CPU)
    "tiny-dense": ModelConfig(
        name="llama", vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, tie_embeddings=True, max_position=512),
    "tiny-qwen3": ModelConfig(
        name="qwen3", vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, qk_norm=True, norm_eps=1e-6, max_position=512),
    "tiny-moe": ModelConfig(
        name="qwen3_moe", vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, qk_norm=True, max_position=512,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, expert_mlp_dim=32, norm_topk_prob=True,
                      aux_loss_coef=0.01, z_loss_coef=0.001)),
    "tiny-deepseek": ModelConfig(
        name="deepseek_v3", vocab_size=128, d_model=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=24,
        mlp_dim=128, max_position=512,
        mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, expert_mlp_dim=32, num_shared_experts=1,
                      scoring="sigmoid", routed_scaling_factor=2.5, num_groups=4, topk_groups=2, first_k_dense=1,
                      dense_mlp_dim=96, score_bias=True, bias_update_rate=0.01)),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named ModelConfig with `overrides` replaced; raises ValueError for an unknown name or override."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as e:
        raise ValueError(f"invalid override for preset {name!r}: {e}") from e
