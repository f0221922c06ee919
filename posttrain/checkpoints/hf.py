"""Hugging Face checkpoints <-> posttrain parameters (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3).

Format: a directory with `config.json` and `model.safetensors` or sharded `model-XXXXX-of-YYYYY.safetensors` plus
`model.safetensors.index.json` (https://huggingface.co/docs/safetensors). HF linear weights are [out, in]; ours
are einsum-shaped ([in, heads, head_dim] etc., see `posttrain.model.layers`).

One bidirectional table per family (`_layer_table`) drives import *and* export, so the two cannot drift apart.
DeepSeek stores its rotary dims interleaved (x0, x1), (x2, x3)...; we permute those rows to the half-split layout
on import (and back on export): q.k is unchanged when both sides get the same permutation.
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import numpy as np

from posttrain.model.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2")


# ------------------------------------------------------------------------------------------- config.json
def _rope_from_hf(hf: Mapping) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope type {kind!r} in config.json")
    return RopeConfig(theta=theta, type=kind, factor=params.get("factor", 1.0),
                      original_max_position=params.get("original_max_position_embeddings", 0) or 0,
                      low_freq_factor=params.get("low_freq_factor", 1.0),
                      high_freq_factor=params.get("high_freq_factor", 4.0),
                      beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                      mscale=params.get("mscale") or 0.0, mscale_all_dim=params.get("mscale_all_dim") or 0.0,
                      attention_factor=params.get("attention_factor"), truncate=params.get("truncate", True))


def config_from_hf(hf: Mapping, *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """ModelConfig from a config.json dict. Raises ValueError for an unsupported model_type or layer pattern."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"unsupported architecture model_type={mt!r}; supported: {SUPPORTED}")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    mla = moe = None
    n_exp = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if mt in ("qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2") and n_exp:
        first_k = hf.get("first_k_dense_replace", 0) if mt in ("deepseek_v3", "kimi_k2") else 0
        if mt == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
            raise ValueError("qwen3_moe with mlp_only_layers or decoder_sparse_step != 1 is not supported")
        deepseek = mt in ("deepseek_v3", "kimi_k2")
        moe = MoEConfig(num_experts=n_exp, num_experts_per_tok=hf["num_experts_per_tok"],
                        expert_mlp_dim=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                        num_shared_experts=hf.get("n_shared_experts") or 0 if deepseek else 0,
                        scoring="sigmoid" if deepseek else "softmax",
                        norm_topk_prob=True if mt == "mixtral" else bool(hf.get("norm_topk_prob", False)),
                        routed_scaling_factor=hf.get("routed_scaling_factor", 1.0) if deepseek else 1.0,
                        num_groups=hf.get("n_group") or 1 if deepseek else 1,
                        topk_groups=hf.get("topk_group") or 1 if deepseek else 1,
                        first_k_dense=first_k, dense_mlp_dim=hf["intermediate_size"] if first_k else 0,
                        score_bias=deepseek, aux_loss_coef=hf.get("router_aux_loss_coef", 0.0) or 0.0)
    if mt in ("deepseek_v3", "kimi_k2"):
        mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                        v_head_dim=hf["v_head_dim"])
    head_dim = hf.get("head_dim") or D // N
    if mla is not None:
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return ModelConfig(vocab_size=hf["vocab_size"], d_model=D, num_layers=hf["num_hidden_layers"], num_heads=N,
                       num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=head_dim,
                       mlp_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope=_rope_from_hf(hf), max_position=hf.get("max_position_embeddings", 8192),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
                       attention_bias=mt == "qwen2" or (bool(hf.get("attention_bias")) and mla is None),
                       mla=mla, moe=moe, dtype=dtype, param_dtype=param_dtype, name=mt)


def hf_family(cfg: ModelConfig) -> str:
    """The HF model_type a ModelConfig exports to (cfg.name when it names a supported family)."""
    if cfg.name in SUPPORTED:
        return cfg.name
    if cfg.mla is not None:
        return "deepseek_v3"
    if cfg.moe is not None:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
         "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM"}


def config_to_hf(cfg: ModelConfig, **extra) -> dict:
    """config.json dict for `cfg` (inverse of `config_from_hf` for the supported families)."""
    mt = hf_family(cfg)
    r = cfg.rope
    rope = {"rope_theta": r.theta, "rope_type": r.type}
    if r.type != "default":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position)
    if r.type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
    hf = {"model_type": mt, "architectures": [_ARCH[mt]], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
          "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_embeddings,
          "rope_parameters": rope, "rope_theta": r.theta, "hidden_act": "silu", "torch_dtype": cfg.param_dtype,
          "attention_bias": cfg.attention_bias}
    if cfg.moe is not None:
        m = cfg.moe
        hf.update(num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.expert_mlp_dim,
                  norm_topk_prob=m.norm_topk_prob, num_experts=m.num_experts, num_local_experts=m.num_experts)
        if mt == "deepseek_v3":
            hf.update(n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts, n_group=m.num_groups,
                      topk_group=m.topk_groups, routed_scaling_factor=m.routed_scaling_factor,
                      first_k_dense_replace=m.first_k_dense, intermediate_size=m.dense_mlp_dim or cfg.mlp_dim)
    if cfg.mla is not None:
        a = cfg.mla
        hf.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_interleave=True,
                  head_dim=a.qk_rope_head_dim, num_nextn_predict_layers=0, attention_bias=False)
    hf.update(extra)
    return hf


# ------------------------------------------------------------------------------------------- tensor table
class Rule(NamedTuple):
    """ours: param paths inside a block; hf: tensor names inside `model.layers.{i}.`;
    to_ours(list of hf arrays) -> list of our arrays; to_hf(list of our arrays) -> list of hf arrays."""

    ours: tuple[str, ...]
    hf: tuple[str, ...]
    to_ours: Callable
    to_hf: Callable


def _one(ours, hf, f, g):
    return Rule((ours,), (hf,), lambda a: [f(a[0])], lambda a: [g(a[0])])


def _linear(ours, hf):  # [out, in] <-> [in, out]
    return _one(ours, hf, lambda w: w.T, lambda w: w.T)


def _heads_in(ours, hf, n, perm=None):  # [n*h, in] <-> [in, n, h]
    def f(w):
        w = w.T.reshape(w.shape[1], n, -1)
        return w if perm is None else w[..., perm]

    def g(w):
        w = w if perm is None else w[..., np.argsort(perm)]
        return w.reshape(w.shape[0], -1).T

    return _one(ours, hf, f, g)


def _heads_out(ours, hf, n):  # [out, n*h] <-> [n, h, out]
    return _one(ours, hf, lambda w: w.T.reshape(n, -1, w.shape[0]), lambda w: w.reshape(-1, w.shape[-1]).T)


def _copy(ours, hf, shape=None):
    return _one(ours, hf, lambda w: w if shape is None else w.reshape(shape), lambda w: w.reshape(-1) if shape else w)


def _experts(ours, template, E):  # E x [out, in] <-> [E, in, out]
    names = tuple(template.format(e=e) for e in range(E))
    return Rule((ours,), names, lambda a: [np.stack([w.T for w in a])], lambda a: [w.T for w in a[0]])


def _rope_perm(nope: int, rope: int) -> np.ndarray:
    return np.concatenate([np.arange(nope), nope + np.arange(0, rope, 2), nope + np.arange(1, rope, 2)])


def layer_table(cfg: ModelConfig, family: str, moe_layer: bool) -> list[Rule]:
    """The rules for one block (dense or MoE) of `family`."""
    N, K = cfg.num_heads, cfg.num_kv_heads
    t = [_copy("input_norm.weight", "input_layernorm.weight"),
         _copy("post_attn_norm.weight", "post_attention_layernorm.weight")]
    if cfg.mla is None:
        t += [_heads_in("attn.q_proj", "self_attn.q_proj.weight", N),
              _heads_in("attn.k_proj", "self_attn.k_proj.weight", K),
              _heads_in("attn.v_proj", "self_attn.v_proj.weight", K),
              _heads_out("attn.o_proj", "self_attn.o_proj.weight", N)]
        if cfg.attention_bias:
            t += [_copy(f"attn.{x}_bias", f"self_attn.{x}_proj.bias", (n, cfg.head_dim))
                  for x, n in (("q", N), ("k", K), ("v", K))]
        if cfg.qk_norm:
            t += [_copy("attn.q_norm.weight", "self_attn.q_norm.weight"),
                  _copy("attn.k_norm.weight", "self_attn.k_norm.weight")]
    else:
        a = cfg.mla
        nope, P, R, V = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
        qperm = _rope_perm(nope, P)
        if a.q_lora_rank:
            t += [_linear("attn.q_a_proj", "self_attn.q_a_proj.weight"),
                  _copy("attn.q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
                  _heads_in("attn.q_b_proj", "self_attn.q_b_proj.weight", N, qperm)]
        else:
            t += [_heads_in("attn.q_proj", "self_attn.q_proj.weight", N, qperm)]
        kvperm = _rope_perm(R, P)
        t += [_one("attn.kv_a_proj", "self_attn.kv_a_proj_with_mqa.weight", lambda w: w.T[:, kvperm],
                   lambda w: w[:, np.argsort(kvperm)].T),
              _copy("attn.kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
              Rule(("attn.k_b_proj", "attn.v_b_proj"), ("self_attn.kv_b_proj.weight",),
                   lambda x: [x[0].reshape(N, nope + V, R)[:, :nope].transpose(2, 0, 1),
                              x[0].reshape(N, nope + V, R)[:, nope:].transpose(2, 0, 1)],
                   lambda x: [np.concatenate([x[0].transpose(1, 2, 0), x[1].transpose(1, 2, 0)], 1).reshape(-1, R)]),
              _heads_out("attn.o_proj", "self_attn.o_proj.weight", N)]
    mixtral = family == "mixtral"
    if not moe_layer:
        return t + [_linear(f"ffn.{p}_proj", f"mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
    m = cfg.moe
    base = "block_sparse_moe" if mixtral else "mlp"
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    t += [_linear("ffn.router", f"{base}.gate.weight")]
    t += [_experts(f"ffn.{p}_proj", f"{base}.experts.{{e}}.{names[p]}.weight", m.num_experts) for p in names]
    if m.score_bias:
        t += [_copy("ffn.score_bias", f"{base}.gate.e_score_correction_bias")]
    if m.num_shared_experts:
        t += [_linear(f"ffn.shared.{p}_proj", f"mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")]
    return t


def top_table(cfg: ModelConfig) -> list[Rule]:
    t = [_copy("embedding", "model.embed_tokens.weight"), _copy("final_norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        t.append(_linear("lm_head", "lm_head.weight"))
    return t


def block_layout(cfg: ModelConfig):
    """[(stack name, first HF layer index, number of layers, is_moe)] in execution order."""
    out = []
    if cfg.num_dense_layers:
        out.append(("dense_layers", 0, cfg.num_dense_layers, False))
    if cfg.num_moe_layers:
        out.append(("moe_layers", cfg.num_dense_layers, cfg.num_moe_layers, True))
    return out
