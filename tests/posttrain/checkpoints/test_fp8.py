"""FP8 block-quantised import (DeepSeek-V3 / Kimi K2 safetensors): exact dequantised weights against a NumPy
dequantisation of the format, logits against transformers run on those weights, per-layer lazy reads, and one clear
error per corrupt file.

Checkpoints: a tiny DeepSeek-V3 built with transformers (float32, weights re-drawn large), quantised here with NumPy
the way DeepSeek-V3's README_WEIGHTS.md describes (128x128 blocks, partial blocks zero-padded for the scale, float8_e4m3fn
weights, float32 `weight_scale_inv`), written as two safetensors shards (scales in the second) plus an index.
hidden_size 160 and q_lora_rank 136 give partial blocks on both axes; intermediate_size 256 gives full ones.
transformers' own CPU fallback (`Fp8Dequantize`, used without a GPU) is not the reference: it derives the block from
the scale grid (rows // scale rows: 68 for q_a_proj's 136 rows), not the format's 128; loading this file with it gave
q_a_proj [136, 160] off by up to 0.29 (|w| <= 0.91) while kv_b_proj [128, 32] came out exact.
"""
import json
import math

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from posttrain.checkpoints import fp8
from posttrain.checkpoints.hf import arrays_to_hf, hf_to_arrays
from posttrain.checkpoints.load import SafetensorsDir, load_hf_dir
from posttrain.checkpoints.export import flat_arrays
from posttrain.checkpoints.hf_config import config_from_hf, normalized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_numpy = pytest.importorskip("safetensors.numpy")
from test_hf import _our_logits, _randomize_torch, _torch_logits  # noqa: E402  (same directory)

V, B = 96, 128
QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
_DEEPSEEK = dict(vocab_size=V, hidden_size=160, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=136,
                 kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=64,
                 routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
# Kimi K2 is DeepSeek-V3's architecture under model_type kimi_k2 with its remote-code keys (test_hf_config.KIMI_K2)
_KIMI = {"model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
         "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
VARIANTS = {"deepseek_v3": (dict(_DEEPSEEK), {}), "kimi_k2": (dict(_DEEPSEEK, n_group=1, topk_group=1,
                                                                   routed_scaling_factor=2.827), _KIMI)}
MTP = {"model.layers.3.eh_proj.weight": (160, 320), "model.layers.3.enorm.weight": (160,)}  # one MTP layer


def quantize(w_OxI: np.ndarray, block=(B, B)):
    """(float8_e4m3fn [O, I], float32 scale_inv [ceil(O/bO), ceil(I/bI)]): each block zero-padded, scaled to amax 448."""
    (O, I), (bo, bi) = w_OxI.shape, block
    so, si = math.ceil(O / bo), math.ceil(I / bi)
    pad = np.zeros((so * bo, si * bi), np.float32)
    pad[:O, :I] = w_OxI
    blocks = pad.reshape(so, bo, si, bi)
    scale = (np.abs(blocks).max(axis=(1, 3)) / 448.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:O, :I]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_ref(q, scale, block=(B, B)):
    """The format's dequantisation written independently of posttrain: the scale grid expanded to full size."""
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


def _quantized(name, a):
    return a.ndim == 2 and "norm" not in name and not name.endswith("mlp.gate.weight") and name not in (
        "model.embed_tokens.weight", "lm_head.weight")


def _write_fp8(path, state: dict, hf_config: dict):
    """Quantises `state` into two shards + index; returns {name: the weight posttrain should load} (NumPy)."""
    weights, scales, ref = {}, {}, {}
    for name, a in state.items():
        if _quantized(name, a):
            weights[name], scales[name + "_scale_inv"] = quantize(a)
            ref[name] = dequantize_ref(weights[name], scales[name + "_scale_inv"])
        else:
            weights[name] = ref[name] = a
    assert any(s.shape[0] * B != weights[n.removesuffix("_scale_inv")].shape[0] for n, s in scales.items())
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for f, t in shards.items():
        st_numpy.save_file(t, path / f, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, t in shards.items() for n in t}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(hf_config))
    return ref


@pytest.fixture(scope="module", params=list(VARIANTS))
def fp8_model(request, tmp_path_factory):
    """(fp8 directory, transformers model loaded from the dequantised weights, {name: dequantised weight},
    config.json of the fp8 directory)."""
    kwargs, edit = VARIANTS[request.param]
    model = _randomize_torch(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("deepseek_v3", num_nextn_predict_layers=1, **kwargs), dtype=torch.float32))
    base = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(base / "f32")  # the checkpoint layout: one [out, in] tensor per expert projection
    state = dict(st_numpy.load_file(base / "f32" / "model.safetensors"))
    rng = np.random.default_rng(0)
    state.update({k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in MTP.items()})
    hf_config = dict(json.loads((base / "f32" / "config.json").read_text()), quantization_config=QC, **edit)
    (base / "fp8").mkdir()
    ref = _write_fp8(base / "fp8", state, hf_config)
    st_numpy.save_file({k: v for k, v in ref.items() if k not in MTP}, base / "f32" / "model.safetensors",
                       metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(base / "f32", dtype=torch.float32).eval()
    return base / "fp8", theirs, ref, hf_config


@pytest.fixture(scope="module")
def loaded(fp8_model):
    return load_hf_dir(fp8_model[0])


def test_weights_match_the_numpy_dequantisation_exactly(fp8_model, loaded):
    path, _, ref, hf_config = fp8_model
    pre = loaded
    assert pre.config.name == json.loads((path / "config.json").read_text())["model_type"]
    back = arrays_to_hf(pre.config, flat_arrays(pre.state))  # our layout -> HF names (exact permutations)
    assert set(back) == set(ref) - set(MTP)
    for name, a in back.items():
        np.testing.assert_array_equal(a, ref[name], err_msg=name)
    assert ref["model.layers.0.self_attn.q_a_proj.weight"].shape == (136, 160)  # partial blocks on both axes
    if hf_config["model_type"] == "deepseek_v3":  # into a bf16 training dtype: the dequantised value, rounded once
        bf16 = arrays_to_hf(pre.config, flat_arrays(load_hf_dir(path, param_dtype="bfloat16").state))
        assert bf16["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == ml_dtypes.bfloat16
        for name, a in bf16.items():
            np.testing.assert_array_equal(a, ref[name].astype(a.dtype), err_msg=name)


@pytest.mark.parity
def test_logits_match_transformers_on_the_dequantised_weights(fp8_model, loaded):
    _, model, _, _ = fp8_model
    tokens = np.random.default_rng(1).integers(0, V, (2, 24))
    theirs = _torch_logits(model, tokens)
    assert theirs.std() > 0.5
    pre = loaded
    np.testing.assert_allclose(_our_logits(pre.graphdef, pre.state, tokens), theirs, rtol=0, atol=1e-4)


def test_dequantize_partial_blocks_against_reference():
    w = np.random.default_rng(2).standard_normal((300, 200)).astype(np.float32)
    q, s = quantize(w)
    assert s.shape == (3, 2) == fp8.scale_shape(w.shape, (B, B))
    got = fp8.dequantize(q, s, (B, B), "w")
    np.testing.assert_array_equal(got, dequantize_ref(q, s))
    assert np.abs(got - w).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits, so within 1/16 of amax per block
    with pytest.raises(ValueError, match=r"'w_scale_inv'.*\(3, 2\).*\(2, 2\)"):
        fp8.dequantize(q, s[:2], (B, B), "w")
    with pytest.raises(ValueError, match=r"'w'.*float8_e4m3fn"):
        fp8.dequantize(w, s, (B, B), "w")


def _expected(cfg):
    """Per-layer parameter shapes, as `convert.place` computes them."""
    from posttrain.model.transformer import Transformer

    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return {p: tuple(v.shape[1:] if p[0].endswith("_layers") else v.shape) for p, v in nnx.to_flat_state(abstract)}


def test_reads_are_lazy_per_layer_and_per_shard(fp8_model):
    """Nothing is read while names and shapes are checked; a shard index reads only its layers (one tensor each)."""
    path, _, ref, hf_config = fp8_model
    reads = []

    class Counting(SafetensorsDir):
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

    cfg = config_from_hf(hf_config)
    lazy = hf_to_arrays(cfg, fp8.Dequantized(Counting(path), (B, B)), _expected(cfg))
    assert reads == []
    q_a = lazy[("moe_layers", "attn", "q_a_proj")]
    assert q_a.shape == (2, 160, 136)  # layers 1 and 2 (layer 0 is dense)
    part = q_a.read((slice(1, 2), slice(0, 100), slice(None)))
    assert reads == ["model.layers.2.self_attn.q_a_proj.weight", "model.layers.2.self_attn.q_a_proj.weight_scale_inv"]
    np.testing.assert_array_equal(part[0], ref["model.layers.2.self_attn.q_a_proj.weight"].T[:100])


# ------------------------------------------------------------------------------------------------ bad input
def _damaged(tmp_path, fp8_model, edit_scales=None, edit_config=None):
    import shutil

    path = shutil.copytree(fp8_model[0], tmp_path / "m")
    if edit_scales:
        f = path / "model-00002-of-00002.safetensors"
        scales = dict(st_numpy.load_file(f))
        edit_scales(scales)
        st_numpy.save_file(scales, f, metadata={"format": "pt"})
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: w for n, w in index["weight_map"].items()
                               if not n.endswith("_scale_inv") or n in scales}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if edit_config:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


SCALE = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
DAMAGE = {  # id -> (scales edit, config.json edit, error regex)
    "scale-wrong-shape": (lambda t: t.update({SCALE: np.ones((1, 2), np.float32)}), None,
                          r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight_scale_inv'.*\(2, 1\).*\(1, 2\)"),
    "scale-missing": (lambda t: t.pop(SCALE), None,
                      r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight' is F8_E4M3 but its scale .* missing"),
    "no-quantization_config": (None, lambda c: c.pop("quantization_config"),
                               r"tensor 'model\.\S+' is F8_E4M3 but config\.json has no quantization_config"),
    "other-quant-method": (None, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
                           r"quant_method='gptq' is not supported"),
    "per-tensor-fp8": (None, lambda c: c["quantization_config"].pop("weight_block_size"),
                       r"weight_block_size=None is not supported"),
    "static-activations": (None, lambda c: c["quantization_config"].update(activation_scheme="static"),
                           r"activation_scheme='static' is not supported"),
}


@pytest.mark.parametrize("fp8_model", ["deepseek_v3"], indirect=True)  # one variant suffices
@pytest.mark.parametrize("case", list(DAMAGE))
def test_corrupt_fp8_checkpoint_is_one_clear_error(tmp_path, fp8_model, case):
    edit_scales, edit_config, error = DAMAGE[case]
    path = _damaged(tmp_path, fp8_model, edit_scales, edit_config)
    with pytest.raises(ValueError, match=error):
        load_hf_dir(path)


@pytest.mark.parametrize("fp8_model", ["deepseek_v3"], indirect=True)
def test_stray_scale_is_unused(tmp_path, fp8_model):
    """A scale whose weight is stored unquantised is read by nothing: check_unused names it."""
    path = _damaged(tmp_path, fp8_model, lambda t: t.update({"model.norm.weight_scale_inv": np.ones((1, 2), np.float32)}))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight_scale_inv"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight_scale_inv'.* not used"):
        load_hf_dir(path)
