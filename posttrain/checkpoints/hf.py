"""Hugging Face tensors <-> posttrain parameters: one bidirectional table per family (docs/checkpoint_formats.md).

Families: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3. Reading files is `load`, writing `export`.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Iterable, Mapping, NamedTuple

import numpy as np

from posttrain.checkpoints.hf_config import SUPPORTED, config_from_hf, config_to_hf, hf_family  # noqa: F401
from posttrain.model.config import ModelConfig

# ------------------------------------------------------------------------------------------- tensor table
class Rule(NamedTuple):
    """Param paths inside a block (`ours`) <-> tensor names inside `model.layers.{i}.` (`hf`), with the converters."""

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


def layer_table(cfg: ModelConfig, family: str, moe_layer: bool, rope_interleave: bool = True) -> list[Rule]:
    """The rules for one block (dense or MoE) of `family`; rope_interleave: DeepSeek's stored rotary layout."""
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
        qperm = _rope_perm(nope, P) if rope_interleave else np.arange(nope + P)
        if a.q_lora_rank:
            t += [_linear("attn.q_a_proj", "self_attn.q_a_proj.weight"),
                  _copy("attn.q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
                  _heads_in("attn.q_b_proj", "self_attn.q_b_proj.weight", N, qperm)]
        else:
            t += [_heads_in("attn.q_proj", "self_attn.q_proj.weight", N, qperm)]
        kvperm = _rope_perm(R, P) if rope_interleave else np.arange(R + P)
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


# Tensors transformers does not load either (rotary caches of older Llama / Mistral exports; DeepSeek-V3's MTP
# layers: `check_unused`'s mtp_layers). Anything else unread is an error: a silently dropped tensor changes the model.
UNUSED_OK = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


def check_unused(names: Iterable[str], used: set[str], num_layers: int, mtp_layers: int = 0) -> None:
    """Raises ValueError naming the tensors neither `used`, allowed by `UNUSED_OK` nor of the `mtp_layers`."""
    def allowed(n):
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m and num_layers <= int(m.group(1)) < num_layers + mtp_layers:
            return True
        return any(re.fullmatch(p, n) for p in UNUSED_OK)

    extra = sorted(n for n in names if n not in used and not allowed(n))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"tensor(s) {', '.join(map(repr, extra[:5]))}{more} in the checkpoint are not used by the "
                         "model its config.json describes (a config key missing or wrong?)")


# -------------------------------------------------------------------------------- HF tensors <-> our arrays
class Lazy(NamedTuple):
    """One parameter read when placed: `shape` (ours) and `read(index)` -> the array at a tuple of slices."""

    shape: tuple
    read: Callable


def _shape(tensors, name) -> tuple:
    return tuple(tensors.shape(name)) if hasattr(tensors, "shape") else tuple(np.shape(tensors[name]))


def _read_top(tensors, rule, names, j, index):
    return np.asarray(rule.to_ours([tensors[n] for n in names])[j])[index]


def _read_stacked(tensors, rule, layers, j, index):
    out = None
    rows = range(len(layers))[index[0]]
    for k, i in enumerate(rows):  # one layer at a time; only this shard's slice is kept
        a = np.asarray(rule.to_ours([tensors[n] for n in layers[i]])[j])[index[1:]]
        out = np.empty((len(rows),) + a.shape, a.dtype) if out is None else out
        out[k] = a
    return out


def hf_to_arrays(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], expected: Mapping[tuple, tuple], *,
                 rope_interleave: bool = True, used: set | None = None) -> dict:
    """{our param path tuple: `Lazy`} from HF-named tensors, checked against the `expected` per-layer shapes.

    Names and shapes are checked up front (from headers when `tensors` has `shape`); `used` collects the names read.
    Raises ValueError for a missing tensor or a shape mismatch (named)."""
    family = hf_family(cfg)
    used = set() if used is None else used

    def hf_shapes(rule, our_prefix):  # the HF shapes the config implies (zero-stride views: nothing allocated)
        want = [expected[our_prefix + tuple(o.split("."))] for o in rule.ours]
        return [tuple(w.shape) for w in rule.to_hf([np.broadcast_to(np.float32(0), s) for s in want])]

    def checked(rule, prefix, our_prefix, shapes):
        names = [prefix + n for n in rule.hf]
        used.update(names)
        for n, w in zip(names, shapes):
            if n not in tensors:
                raise ValueError(f"missing tensor {n!r} (needed for {cfg.name or family} {our_prefix}{rule.ours})")
            if _shape(tensors, n) != w:
                raise ValueError(f"tensor {n!r}: expected shape {w} from the config, found {_shape(tensors, n)}")
        return names

    out = {}
    for rule in top_table(cfg):
        names = checked(rule, "", (), hf_shapes(rule, ()))
        for j, o in enumerate(rule.ours):
            path = tuple(o.split("."))
            out[path] = Lazy(tuple(expected[path]), functools.partial(_read_top, tensors, rule, names, j))
    for stack, first, num, is_moe in block_layout(cfg):
        for rule in layer_table(cfg, family, is_moe, rope_interleave):
            shapes = hf_shapes(rule, (stack,))
            layers = [checked(rule, f"model.layers.{first + i}.", (stack,), shapes) for i in range(num)]
            for j, o in enumerate(rule.ours):
                path = (stack,) + tuple(o.split("."))
                out[path] = Lazy((num,) + tuple(expected[path]),
                                 functools.partial(_read_stacked, tensors, rule, layers, j))
    return out


def arrays_to_hf(cfg: ModelConfig, arrays: Mapping[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of `hf_to_arrays`: HF-named tensors from our param arrays."""
    family = hf_family(cfg)
    out = {}
    for rule in top_table(cfg):
        for n, a in zip(rule.hf, rule.to_hf([arrays[tuple(o.split("."))] for o in rule.ours])):
            out[n] = a
    for stack, first, num, is_moe in block_layout(cfg):
        for rule in layer_table(cfg, family, is_moe):
            for i in range(num):
                ours = [arrays[(stack,) + tuple(o.split("."))][i] for o in rule.ours]
                for n, a in zip(rule.hf, rule.to_hf(ours)):
                    out[f"model.layers.{first + i}.{n}"] = a
    return out
