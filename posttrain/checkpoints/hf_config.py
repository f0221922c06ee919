"""config.json <-> ModelConfig for the supported Hugging Face families, with transformers' defaults.

Each field is read, allowed only with the values we implement, or ignored (`FIELDS`; docs/checkpoint_formats.md).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from posttrain.checkpoints.fp8 import weight_block
from posttrain.model.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
          "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


class Field(NamedTuple):
    default: Any = None
    kind: str = "read"  # read | only | ignored
    allowed: tuple = ()
    nullable: bool = False


def _only(*allowed, default=None):
    return Field(allowed[0] if default is None else default, "only", allowed)


_IGNORED = Field(kind="ignored")
_NULLABLE = Field(None, nullable=True)
# PreTrainedConfig's own fields (transformers/configuration_utils.py) plus the generation/cache/initialisation
# fields every family declares: none changes the forward pass. `dtype` is read by `file_dtype`.
GENERIC = frozenset({"transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
                     "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                     "problem_type", "_name_or_path", "output_attentions", "model_type", "auto_map",
                     "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
                     "output_router_logits", "pretraining_tp", "rope_theta", "rope_scaling"})


def _base(V, D, F, L, N, K, max_pos, eps=1e-6, **extra) -> dict[str, Field]:
    return {"vocab_size": Field(V), "hidden_size": Field(D), "intermediate_size": Field(F),
            "num_hidden_layers": Field(L), "num_attention_heads": Field(N),
            "num_key_value_heads": Field(K, nullable=True), "hidden_act": _only("silu"),
            "max_position_embeddings": Field(max_pos), "rms_norm_eps": Field(eps), "tie_word_embeddings": Field(False),
            "rope_parameters": _NULLABLE, "attention_dropout": _only(0.0, 0), **extra}


_QWEN_WINDOW = dict(use_sliding_window=Field(False), sliding_window=Field(4096, nullable=True),
                    max_window_layers=Field(28), layer_types=_NULLABLE)
_DEEPSEEK = _base(
    129280, 7168, 18432, 61, 128, 128, 4096, moe_intermediate_size=Field(2048), n_shared_experts=Field(1),
    n_routed_experts=Field(256), routed_scaling_factor=Field(2.5), kv_lora_rank=Field(512),
    q_lora_rank=Field(1536, nullable=True), qk_rope_head_dim=Field(64), v_head_dim=Field(128),
    qk_nope_head_dim=Field(128), n_group=Field(8), topk_group=Field(4), num_experts_per_tok=Field(8),
    first_k_dense_replace=Field(3), norm_topk_prob=Field(True), rope_interleave=Field(True),
    attention_bias=_only(False), num_mtp_layers=Field(1),
    head_dim=_IGNORED, qk_head_dim=_IGNORED,  # transformers overwrites both (qk_rope_head_dim, nope + rope)
    # remote-code keys of the released DeepSeek-V3 / Kimi K2 config.json files (not in transformers' class)
    scoring_func=_only("sigmoid"), topk_method=_only("noaux_tc"), moe_layer_freq=_only(1),
    ep_size=_IGNORED, aux_loss_alpha=_IGNORED, seq_aux=_IGNORED)  # parallelism / training-only loss settings
FIELDS: dict[str, dict[str, Field]] = {
    "llama": _base(32000, 4096, 11008, 32, 32, None, 2048, attention_bias=_only(False), mlp_bias=_only(False),
                   head_dim=_NULLABLE),
    "mistral": _base(32000, 4096, 14336, 32, 32, 8, 131072, head_dim=_NULLABLE,
                     sliding_window=Field(4096, nullable=True)),
    "qwen2": _base(151936, 4096, 22016, 32, 32, 32, 32768, head_dim=_NULLABLE, **_QWEN_WINDOW),
    "qwen3": _base(151936, 4096, 22016, 32, 32, 32, 32768, head_dim=Field(128), attention_bias=_only(False),
                   **_QWEN_WINDOW),
    "qwen3_moe": _base(151936, 2048, 6144, 24, 32, 4, 32768, attention_bias=_only(False),
                       use_sliding_window=Field(False), sliding_window=Field(4096, nullable=True),
                       decoder_sparse_step=_only(1), moe_intermediate_size=Field(768), num_experts_per_tok=Field(8),
                       num_experts=Field(128), norm_topk_prob=Field(False), router_aux_loss_coef=Field(0.001),
                       mlp_only_layers=Field(None, "only", (None, []), nullable=True), head_dim=_NULLABLE),
    "mixtral": _base(32000, 4096, 14336, 32, 32, 8, 131072, eps=1e-5, head_dim=_NULLABLE,
                     sliding_window=_NULLABLE, num_experts_per_tok=Field(2), num_local_experts=Field(8),
                     router_aux_loss_coef=Field(0.001), router_jitter_noise=_only(0.0, 0)),
    "deepseek_v3": _DEEPSEEK,
}
# alias -> field (transformers' attribute_map, and the names real config.json files use)
ALIASES = {"qwen3_moe": {"num_local_experts": "num_experts"}, "mixtral": {"num_experts": "num_local_experts"},
           "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_nextn_predict_layers": "num_mtp_layers"}}
DEFAULT_THETA = {"mixtral": 1e6}  # transformers' `default_theta` class attribute; 10000 elsewhere


def table_family(model_type: str) -> str:
    """The FIELDS key for a model_type (kimi_k2 -> deepseek_v3); ValueError for an unsupported one."""
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {SUPPORTED}")
    return "deepseek_v3" if model_type == "kimi_k2" else model_type


def normalized(hf: Mapping) -> dict:
    """config.json with aliases renamed to transformers' field names, checked against `FIELDS`.

    Returns {field: value} for every field of the family (defaults for absent keys), plus `model_type`, the rope
    keys, `dtype` and `weight_block_size` (`fp8.weight_block`). Raises ValueError for an unsupported family or value."""
    family = table_family(hf.get("model_type"))
    table = FIELDS[family]
    hf = dict(hf)
    for alias, name in ALIASES.get(family, {}).items():
        if alias in hf and name not in hf:
            hf[name] = hf.pop(alias)
    block = weight_block(hf.get("quantization_config"))  # fp8 block quantisation only; anything else raises
    out = {k: hf[k] for k in ("model_type", "rope_theta", "rope_scaling", "partial_rotary_factor") if k in hf}
    for key, spec in table.items():
        value = hf.get(key, spec.default)
        given = "" if key in hf else " (transformers' default; the key is absent)"
        if key in hf and value is None and not spec.nullable and spec.kind != "ignored":
            raise ValueError(f"config.json {key} is null; {family} needs a value (transformers' default: "
                             f"{spec.default!r})")
        if spec.kind == "only" and value not in spec.allowed:
            raise ValueError(f"config.json {key}={value!r}{given} is not supported for {family}; supported: "
                             f"{list(spec.allowed)}")
        out[key] = value
    if out.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={out['partial_rotary_factor']} is not supported")
    out["dtype"] = file_dtype(hf)
    out["weight_block_size"] = block
    return out


def file_dtype(hf: Mapping) -> str:
    """The checkpoint's dtype from config.json `dtype` or `torch_dtype` (default float32); ValueError for others."""
    for key in ("dtype", "torch_dtype"):
        value = hf.get(key)
        if value is not None:
            name = str(value).removeprefix("torch.")
            if name not in DTYPES:
                raise ValueError(f"config.json {key}={value!r} is not supported; expected one of {sorted(DTYPES)}")
            return DTYPES[name]
    return "float32"


def _rope_from_hf(c: Mapping, family: str) -> RopeConfig:
    # transformers' PreTrainedConfig.convert_rope_params_to_dict: rope_scaling wins over rope_parameters; theta
    # from the dict, else the legacy rope_theta, else the family default; scaled types default
    # original_max_position_embeddings to max_position_embeddings.
    params = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    theta = params.get("rope_theta", c.get("rope_theta", DEFAULT_THETA.get(family, 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"config.json rope type {kind!r} is not supported; supported: default, linear, llama3, yarn")
    orig = params.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = params.get("factor")
    if factor is None and kind == "yarn":
        factor = c["max_position_embeddings"] / orig
    return RopeConfig(theta=theta, type=kind, factor=1.0 if factor is None else factor, original_max_position=orig,
                      low_freq_factor=params.get("low_freq_factor", 1.0),
                      high_freq_factor=params.get("high_freq_factor", 4.0),
                      beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                      mscale=params.get("mscale") or 0.0, mscale_all_dim=params.get("mscale_all_dim") or 0.0,
                      attention_factor=params.get("attention_factor"), truncate=params.get("truncate", True))


def _check_window(c: Mapping, family: str) -> None:
    """Refuses sliding-window attention that can bind (window < max_position_embeddings) on any layer."""
    window, max_pos = c.get("sliding_window"), c["max_position_embeddings"]
    if family in ("qwen2", "qwen3", "qwen3_moe") and not c["use_sliding_window"]:
        window = None  # Qwen*Config.__post_init__
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json layer_types {unknown} are not supported")
    if family in ("qwen2", "qwen3") and c.get("layer_types") is None and window is not None:
        types = ["sliding_attention" if i >= c["max_window_layers"] else "full_attention"
                 for i in range(c["num_hidden_layers"])]
    sliding = family in ("mistral", "mixtral", "qwen3_moe") or "sliding_attention" in types
    if window is not None and sliding and window < max_pos:
        raise ValueError(f"config.json sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
                         f"attention is not supported ({family})")


def config_from_hf(hf: Mapping, *, dtype: str | None = None, param_dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict, with transformers' defaults for absent keys.

    dtype / param_dtype: compute and storage dtypes (None: `file_dtype`). Raises ValueError for an unsupported
    model_type, value (named) or layer pattern."""
    c = normalized(hf)
    mt = c["model_type"]
    family = table_family(mt)
    _check_window(c, family)
    D, N = c["hidden_size"], c["num_attention_heads"]
    deepseek = family == "deepseek_v3"
    mla = moe = None
    head_dim = c.get("head_dim") or D // N
    if deepseek:
        mla = MLAConfig(q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                        qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                        v_head_dim=c["v_head_dim"])
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    n_exp = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    if n_exp:
        first_k = c["first_k_dense_replace"] if deepseek else 0
        moe = MoEConfig(num_experts=n_exp, num_experts_per_tok=c["num_experts_per_tok"],
                        expert_mlp_dim=c.get("moe_intermediate_size") or c["intermediate_size"],
                        num_shared_experts=c["n_shared_experts"] if deepseek else 0,
                        scoring="sigmoid" if deepseek else "softmax",
                        norm_topk_prob=True if family == "mixtral" else bool(c["norm_topk_prob"]),
                        routed_scaling_factor=c["routed_scaling_factor"] if deepseek else 1.0,
                        num_groups=c["n_group"] if deepseek else 1, topk_groups=c["topk_group"] if deepseek else 1,
                        first_k_dense=first_k, dense_mlp_dim=c["intermediate_size"] if first_k else 0,
                        score_bias=deepseek, aux_loss_coef=c.get("router_aux_loss_coef", 0.0))
    dtype = dtype or c["dtype"]
    return ModelConfig(vocab_size=c["vocab_size"], d_model=D, num_layers=c["num_hidden_layers"], num_heads=N,
                       num_kv_heads=c["num_key_value_heads"] or N, head_dim=head_dim,
                       mlp_dim=c["intermediate_size"], norm_eps=c["rms_norm_eps"], rope=_rope_from_hf(c, family),
                       max_position=c["max_position_embeddings"], tie_embeddings=bool(c["tie_word_embeddings"]),
                       qk_norm=family in ("qwen3", "qwen3_moe"), attention_bias=family == "qwen2",
                       mla=mla, moe=moe, dtype=dtype, param_dtype=param_dtype or c["dtype"], name=mt)


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


def _check_exportable(m: MoEConfig, mt: str) -> None:
    """Raises ValueError when the HF family `mt` cannot express the routing of `m`."""
    want = {"scoring": "sigmoid" if mt == "deepseek_v3" else "softmax"}
    if mt != "deepseek_v3":
        want.update(num_shared_experts=0, num_groups=1, topk_groups=1, routed_scaling_factor=1.0, score_bias=False,
                    first_k_dense=0)
    if mt == "mixtral":
        want["norm_topk_prob"] = True
    bad = {k: getattr(m, k) for k, v in want.items() if getattr(m, k) != v}
    if bad:
        raise ValueError(f"MoE settings {bad} cannot be exported as HF {mt} (it needs {want})")


def config_to_hf(cfg: ModelConfig, *, dtype: str | None = None, **extra) -> dict:
    """config.json dict for `cfg` (inverse of `config_from_hf`), every behaviour field explicit; `extra`: more keys."""
    mt = hf_family(cfg)
    mt = "deepseek_v3" if mt == "kimi_k2" else mt  # kimi_k2 is remote code: export under the transformers class
    r = cfg.rope
    rope = {"rope_theta": r.theta, "rope_type": r.type}
    if r.type != "default":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position)
    if r.type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim,
                    truncate=r.truncate)
        if r.attention_factor is not None:
            rope.update(attention_factor=r.attention_factor)
    hf = {"model_type": mt, "architectures": [_ARCH[mt]], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
          "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_embeddings,
          "rope_parameters": rope, "hidden_act": "silu", "dtype": dtype or cfg.param_dtype,
          "torch_dtype": dtype or cfg.param_dtype,  # the key transformers < 4.56 and the engines built on it read
          "attention_dropout": 0.0}
    if mt not in ("qwen2", "mistral", "mixtral"):
        hf["attention_bias"] = False
    if mt in ("mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"):
        hf["sliding_window"] = None
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        hf["use_sliding_window"] = False
    if cfg.moe is not None:
        m = cfg.moe
        _check_exportable(m, mt)
        hf.update(num_experts_per_tok=m.num_experts_per_tok, router_aux_loss_coef=m.aux_loss_coef)
        if mt == "qwen3_moe":
            hf.update(num_experts=m.num_experts, moe_intermediate_size=m.expert_mlp_dim,
                      norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
        elif mt == "mixtral":
            hf.update(num_local_experts=m.num_experts, intermediate_size=m.expert_mlp_dim)
        elif mt == "deepseek_v3":
            hf.update(n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts, n_group=m.num_groups,
                      topk_group=m.topk_groups, routed_scaling_factor=m.routed_scaling_factor,
                      moe_intermediate_size=m.expert_mlp_dim, norm_topk_prob=m.norm_topk_prob,
                      first_k_dense_replace=m.first_k_dense, intermediate_size=m.dense_mlp_dim or cfg.mlp_dim)
    if cfg.mla is not None:
        a = cfg.mla
        hf.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_interleave=True,
                  head_dim=a.qk_rope_head_dim, num_nextn_predict_layers=0)
    hf.update(extra)
    return hf
