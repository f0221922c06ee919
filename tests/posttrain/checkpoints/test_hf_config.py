"""config.json reading: every field transformers' config classes declare is read with transformers' default or
refused with a clear error (field by field against the classes), derived defaults agree end to end, omitted keys
give transformers' logits, and Kimi K2's remote-code config is covered by DeepSeek-V3's table."""
import dataclasses

import pytest

from posttrain.checkpoints import hf_config
from posttrain.checkpoints.hf_config import ALIASES, FIELDS, GENERIC, config_from_hf

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"]
# keys the class does not declare but that the modeling code reads (head_dim), or that released DeepSeek-V3 /
# Kimi K2 config.json files carry for their remote code
UNDECLARED = {"deepseek_v3": {"scoring_func", "topk_method", "moe_layer_freq", "ep_size", "aux_loss_alpha",
                              "seq_aux", "head_dim", "qk_head_dim"}, "qwen2": {"head_dim"}, "qwen3_moe": {"head_dim"}}
# moonshotai/Kimi-K2-Instruct config.json (remote code, model_type kimi_k2), transcribed from the published file
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840}


def _class(family):
    return type(transformers.AutoConfig.for_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_transformers_field_is_handled_with_its_default(family):
    cls = _class(family)
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}
    table = FIELDS[family]
    unhandled = sorted(set(fields) - set(table) - GENERIC)
    assert not unhandled, f"{family}: transformers fields with no rule: {unhandled}"
    for name, default in fields.items():
        if name in table and table[name].kind != "ignored":
            assert table[name].default == default, (family, name, table[name].default, default)
    stale = sorted(set(table) - set(fields) - UNDECLARED.get(family, set()))
    assert not stale, f"{family}: rules for fields transformers does not declare: {stale}"
    for alias, target in getattr(cls, "attribute_map", {}).items():  # aliases resolve to the declared field
        field = alias if alias in fields else target
        other = target if field == alias else alias
        assert ALIASES[family][other] == field, (family, alias, target)


@pytest.mark.parametrize("family", FAMILIES)
def test_absent_keys_give_the_same_config_as_transformers_full_dict(family):
    """Defaults end to end, derived ones included (head_dim, num_key_value_heads, Mixtral's rope theta 1e6)."""
    minimal = {"model_type": family}
    if family == "mistral":  # its default 4096-token window is refused (below); transformers' dict carries it too
        minimal["sliding_window"] = None
    full = transformers.AutoConfig.for_model(**minimal).to_dict()
    assert config_from_hf(minimal) == config_from_hf(full)


def test_a_few_absent_defaults_by_value():
    ds = config_from_hf({"model_type": "deepseek_v3"})
    assert (ds.moe.norm_topk_prob, ds.moe.num_groups, ds.moe.topk_groups, ds.moe.routed_scaling_factor,
            ds.moe.num_shared_experts, ds.moe.first_k_dense) == (True, 8, 4, 2.5, 1, 3)
    assert config_from_hf({"model_type": "mixtral"}).rope.theta == 1e6
    assert config_from_hf({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
                           "num_key_value_heads": 4}).head_dim == 128
    assert config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}).head_dim == 16
    assert config_from_hf({"model_type": "qwen3_moe"}).moe.norm_topk_prob is False


@pytest.mark.parametrize("family, edit, message", [
    ("llama", {"mlp_bias": True}, r"mlp_bias=True is not supported for llama"),
    ("llama", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("qwen3", {"attention_bias": True}, r"attention_bias=True is not supported for qwen3"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("llama", {"attention_dropout": 0.1}, r"attention_dropout=0.1"),
    ("mistral", {}, r"sliding_window=4096 < max_position_embeddings=131072"),  # transformers' default window
    ("mixtral", {"sliding_window": 16}, r"sliding_window=16"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, r"sliding_window=16"),
    ("qwen3", {"layer_types": ["chunked_attention"] * 32}, r"layer_types \['chunked_attention'\]"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func='softmax'"),
    ("deepseek_v3", {"topk_method": "greedy"}, r"topk_method='greedy'"),
    ("deepseek_v3", {"moe_layer_freq": 2}, r"moe_layer_freq=2"),
    ("deepseek_v3", {"n_group": None}, r"n_group is null"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config.*'fp8'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic'"),
    ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ("llama", {"dtype": "float8_e4m3fn"}, r"dtype='float8_e4m3fn'"),
    ("gpt_neox", {}, r"unsupported architecture model_type='gpt_neox'"),
])
def test_unsupported_values_are_refused_by_name(family, edit, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({"model_type": family, **edit})


@pytest.mark.parametrize("value, expected", [(None, "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                                             ("float32", "float32"), ("torch.bfloat16", "bfloat16")])
@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_file_dtype_is_read_from_either_key(key, value, expected):
    cfg = config_from_hf({"model_type": "qwen3", key: value})
    assert (cfg.param_dtype, cfg.dtype) == (expected, expected)
    assert config_from_hf({"model_type": "qwen3", key: value}, dtype="float32", param_dtype="float16").param_dtype \
        == "float16"


def test_kimi_k2_keys_are_covered_by_deepseek_v3():
    cls = _class("deepseek_v3")
    known = ({f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map) | GENERIC | set(FIELDS["deepseek_v3"])
             | set(ALIASES["deepseek_v3"]) | {"quantization_config"})
    assert not sorted(set(KIMI_K2) - known)
    assert hf_config.normalized(KIMI_K2)["weight_block_size"] == (128, 128)  # FP8 blocks: read, dequantised on load
    cfg = config_from_hf(KIMI_K2)
    assert cfg == config_from_hf({k: v for k, v in KIMI_K2.items() if k != "quantization_config"})
    assert cfg.name == "kimi_k2" and cfg.param_dtype == "bfloat16"
    assert (cfg.moe.num_experts, cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.routed_scaling_factor,
            cfg.moe.first_k_dense, cfg.num_heads) == (384, 1, 1, 2.827, 1, 64)
    assert (cfg.rope.type, cfg.rope.factor, cfg.rope.theta, cfg.rope.original_max_position) == ("yarn", 32.0, 5e4, 4096)
    assert hf_config.config_to_hf(cfg)["model_type"] == "deepseek_v3"  # exported for transformers' own class
