"""Transformer layers (Flax NNX): RMSNorm, RoPE, GQA and MLA attention, gated MLP.

Parameters carry `logical_axes` (mapped by `posttrain.infra.mesh.RULES`). Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from posttrain.model.attention import CacheHook, Source, multi_source_attention
from posttrain.model.blockwise_attention import attend
from posttrain.model.config import LoRAConfig, MLAConfig, RopeConfig
from posttrain.infra.partitioning import with_logical_constraint
from posttrain.infra.precision import lax_precision


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, *, init: str = "normal",
          fan_in: int | None = None, std: float | None = None) -> nnx.Param:
    """An `nnx.Param` with `logical_axes` metadata. init: normal (std = fan_in^-0.5 or `std`), ones, zeros."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        scale = std if std is not None else (fan_in or shape[0]) ** -0.5
        value = (scale * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


# Saveable activations for the remat policies: "dot" every weight-matmul output (compute dtype), "qkv" after RoPE,
# "attn_out" before the output projection, "mlp_in" the normed MLP/MoE input.
CHECKPOINT_NAMES = ("dot", "qkv", "attn_out", "mlp_in")


def dot(eq: str, x: jax.Array, w: jax.Array, dtype, precision=None) -> jax.Array:
    """einsum in `dtype` with float32 accumulation, cast back to `dtype` and named "dot" (saved by remat "dots")."""
    y = jnp.einsum(eq, x.astype(dtype), w.astype(dtype), precision=precision, preferred_element_type=jnp.float32)
    return checkpoint_name(y.astype(dtype), "dot")


class LoRAParam(nnx.Param):
    """A low-rank adapter factor: the trainable Params under LoRA (the base `nnx.Param`s stay frozen)."""


def add_adapters(module: nnx.Module, lora: LoRAConfig | None, shapes: dict, rngs: nnx.Rngs, param_dtype) -> None:
    """Adds `<name>_lora_a` [in, r] and zero `<name>_lora_b` [r, out] per targeted {name: (in, out)} of `shapes`."""
    module.lora_scale = 0.0
    if lora is None or not lora.rank:
        return
    module.lora_scale = lora.alpha / lora.rank
    for name, (d_in, d_out) in shapes.items():
        if name in lora.targets:
            a = (d_in ** -0.5 * jax.random.normal(rngs.params(), (d_in, lora.rank), jnp.float32)).astype(param_dtype)
            setattr(module, f"{name}_lora_a", LoRAParam(a, logical_axes=(None, "lora_rank")))
            setattr(module, f"{name}_lora_b", LoRAParam(jnp.zeros((lora.rank, d_out), param_dtype),
                                                        logical_axes=("lora_rank", None)))


def project(module: nnx.Module, name: str, eq: str, x_BxTx_: jax.Array, dtype) -> jax.Array:
    """`dot(eq, x, module.<name>)` plus scale * (x A) B when `module` has an adapter for `name` (x: [B, T, ...])."""
    y = dot(eq, x_BxTx_, getattr(module, name)[...], dtype)
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return y
    b = getattr(module, f"{name}_lora_b")
    xf = x_BxTx_.reshape(x_BxTx_.shape[:2] + (-1,))
    delta = dot("btr,ro->bto", dot("btk,kr->btr", xf, a[...], dtype), b[...], dtype)
    return y + (module.lora_scale * delta.astype(jnp.float32)).reshape(y.shape).astype(y.dtype)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float, *, axis_name: str = "embed", param_dtype=jnp.float32, rngs=None):
        self.eps = eps
        self.weight = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight.astype(jnp.float32)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------- RoPE
def rope_frequencies(dim: int, rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin factor: linear, Llama 3.1 or YaRN (arXiv:2309.00071)."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exps, dtype=np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    factor = 1.0
    if rope.type == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32), factor
    if rope.type == "llama3":
        old = rope.original_max_position
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / rope.factor, inv)
        smooth = (old / wl - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        mid = ~(wl < high_wl) & ~(wl > low_wl)
        return np.where(mid, smoothed, scaled).astype(np.float32), factor
    if rope.type == "yarn":
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.attention_factor is not None:
            factor = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        else:
            factor = mscale(rope.factor)

        def corr_dim(rot):
            return dim * math.log(rope.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv = (inv / rope.factor) * (1 - extrap) + inv * extrap
        return inv.astype(np.float32), float(factor)
    return inv, factor


def rope_cos_sin(positions_BxT: jax.Array, inv_freq: np.ndarray, factor: float):
    """cos, sin [B, T, dim/2] in float32 for integer positions."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x_BxTxNxH: jax.Array, cos_BxTxh: jax.Array, sin_BxTxh: jax.Array) -> jax.Array:
    """Rotates halves (x1, x2) of the last dim: the HF "rotate_half" layout. Computed in float32."""
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos_BxTxh[:, :, None, :], sin_BxTxh[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_BxTxNxH.dtype)


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with optional q/k RMSNorm (Qwen3) and qkv bias (Qwen2)."""

    def __init__(self, *, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RopeConfig,
                 qk_norm: bool, bias: bool, norm_eps: float, dtype, param_dtype, rngs: nnx.Rngs,
                 lora: LoRAConfig | None = None, matmul_precision: str = "default",
                 attention_impl: str = "auto"):
        D, N, K, H = d_model, num_heads, num_kv_heads, head_dim
        self.dtype, self.head_dim, self.rope, self.matmul_precision = dtype, H, rope, matmul_precision
        self.attention_impl = attention_impl
        self.q_proj = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype, fan_in=D)
        self.k_proj = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype, fan_in=D)
        self.v_proj = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype, fan_in=D)
        self.o_proj = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype, fan_in=N * H)
        self.bias = bias
        if bias:
            self.q_bias = param(rngs, (N, H), ("heads", "head_dim"), param_dtype, init="zeros")
            self.k_bias = param(rngs, (K, H), ("kv_heads", "head_dim"), param_dtype, init="zeros")
            self.v_bias = param(rngs, (K, H), ("kv_heads", "head_dim"), param_dtype, init="zeros")
        self.q_norm = RMSNorm(H, norm_eps, axis_name="head_dim", param_dtype=param_dtype, rngs=rngs) if qk_norm else None
        self.k_norm = RMSNorm(H, norm_eps, axis_name="head_dim", param_dtype=param_dtype, rngs=rngs) if qk_norm else None
        add_adapters(self, lora, {"q_proj": (D, N * H), "k_proj": (D, K * H), "v_proj": (D, K * H),
                                  "o_proj": (N * H, D)}, rngs, param_dtype)

    def __call__(self, x_BxTxD, positions_BxT, mask, extra_sources: Sequence[Source] = ()):
        """(y [B, T, D], entries {"k", "v"} of these tokens); mask: bool [B, T, T] or `RowIds` (no extra sources)."""
        q = project(self, "q_proj", "btd,dnh->btnh", x_BxTxD, self.dtype)
        k = project(self, "k_proj", "btd,dkh->btkh", x_BxTxD, self.dtype)
        v = project(self, "v_proj", "btd,dkh->btkh", x_BxTxD, self.dtype)
        if self.bias:
            q, k, v = (a + b[...].astype(a.dtype) for a, b in ((q, self.q_bias), (k, self.k_bias), (v, self.v_bias)))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions_BxT, *rope_frequencies(self.head_dim, self.rope))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        q, k, v = (checkpoint_name(a, "qkv") for a in (q, k, v))
        entries = {"k": k, "v": v}
        o = attend(q, entries, mask, self.head_dim ** -0.5, lax_precision(self.matmul_precision), extra_sources,
                   self.attention_impl)
        o = checkpoint_name(o, "attn_out")
        return project(self, "o_proj", "btnh,nhd->btd", o, self.dtype), entries


def _latent_logits(q_BxTxNxC, kv):
    return jnp.einsum("btnc,bsc->btns", q_BxTxNxC, kv["kv"], preferred_element_type=jnp.float32)


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3); cache entries {"kv": [R + P]} per token (docs/attention.md).

    With cached sources the up-projections are absorbed into q and the output (DeepSeek-V2 §2.1.3)."""

    def __init__(self, *, d_model: int, num_heads: int, mla: MLAConfig, rope: RopeConfig, norm_eps: float,
                 dtype, param_dtype, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
                 matmul_precision: str = "default", attention_impl: str = "auto"):
        D, N, R, P = d_model, num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
        self.dtype, self.N, self.R, self.P, self.matmul_precision = dtype, N, R, P, matmul_precision
        self.attention_impl = attention_impl
        self.nope, self.vdim = mla.qk_nope_head_dim, mla.v_head_dim
        qk = self.nope + P
        self.rope = rope
        self.scale = qk ** -0.5
        if rope.type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
            m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            self.scale *= m * m
        if mla.q_lora_rank:
            Q = mla.q_lora_rank
            self.q_a_proj = param(rngs, (D, Q), ("embed", "q_lora"), param_dtype, fan_in=D)
            self.q_a_norm = RMSNorm(Q, norm_eps, axis_name="q_lora", param_dtype=param_dtype, rngs=rngs)
            self.q_b_proj = param(rngs, (Q, N, qk), ("q_lora", "heads", "head_dim"), param_dtype, fan_in=Q)
        else:
            self.q_proj = param(rngs, (D, N, qk), ("embed", "heads", "head_dim"), param_dtype, fan_in=D)
        self.q_lora = bool(mla.q_lora_rank)
        self.kv_a_proj = param(rngs, (D, R + P), ("embed", "kv_lora"), param_dtype, fan_in=D)
        self.kv_a_norm = RMSNorm(R, norm_eps, axis_name="kv_lora", param_dtype=param_dtype, rngs=rngs)
        self.k_b_proj = param(rngs, (R, N, self.nope), ("kv_lora", "heads", "head_dim"), param_dtype, fan_in=R)
        self.v_b_proj = param(rngs, (R, N, self.vdim), ("kv_lora", "heads", "head_dim"), param_dtype, fan_in=R)
        self.o_proj = param(rngs, (N, self.vdim, D), ("heads", "head_dim", "embed"), param_dtype, fan_in=N * self.vdim)
        Q = mla.q_lora_rank or 0
        q_shapes = {"q_a_proj": (D, Q), "q_b_proj": (Q, N * qk)} if Q else {"q_proj": (D, N * qk)}
        add_adapters(self, lora, {**q_shapes, "kv_a_proj": (D, R + P), "o_proj": (N * self.vdim, D)}, rngs,
                     param_dtype)

    def __call__(self, x_BxTxD, positions_BxT, mask, extra_sources: Sequence[Source] = ()):
        """(y [B, T, D], entries {"kv"}); `mask` as in `Attention.__call__`."""
        dt = self.dtype
        if self.q_lora:
            q = project(self, "q_b_proj", "btq,qnh->btnh",
                        self.q_a_norm(project(self, "q_a_proj", "btd,dq->btq", x_BxTxD, dt)), dt)
        else:
            q = project(self, "q_proj", "btd,dnh->btnh", x_BxTxD, dt)
        q_nope, q_rot = q[..., :self.nope], q[..., self.nope:]
        ckv = project(self, "kv_a_proj", "btd,dc->btc", x_BxTxD, dt)
        latent, k_rot = self.kv_a_norm(ckv[..., :self.R]), ckv[..., self.R:]
        cos, sin = rope_cos_sin(positions_BxT, *rope_frequencies(self.P, self.rope))
        q_rot = apply_rope(q_rot, cos, sin)
        k_rot = apply_rope(k_rot[:, :, None, :], cos, sin)[:, :, 0, :]
        entries = {"kv": jnp.concatenate([latent, k_rot], axis=-1)}
        if not extra_sources:  # expanded form
            k_nope = dot("btr,rnh->btnh", latent, self.k_b_proj[...], dt)
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None, :], k_nope.shape[:3] + (self.P,))], -1)
            v = dot("btr,rnh->btnh", latent, self.v_b_proj[...], dt)
            qf, k, v = (checkpoint_name(a, "qkv") for a in (jnp.concatenate([q_nope, q_rot], axis=-1), k, v))
            o = attend(qf, {"k": k, "v": v}, mask, self.scale, lax_precision(self.matmul_precision),
                       impl=self.attention_impl)
        else:  # absorbed form over compressed entries
            q_lat = dot("btnh,rnh->btnr", q_nope, self.k_b_proj[...], dt)
            qc = jnp.concatenate([q_lat, q_rot], axis=-1)
            R = self.R

            def combine(p, kv):
                return jnp.einsum("btns,bsr->btnr", p, kv["kv"][..., :R], preferred_element_type=jnp.float32)

            if len(extra_sources) == 1 and isinstance(extra_sources[0], CacheHook):  # the caller's cache
                o_lat = extra_sources[0].fn(qc, entries, self.scale)[..., :R]
            else:
                sources = [*extra_sources, Source(entries, mask)]
                o_lat = multi_source_attention(qc, sources, self.scale, _latent_logits, combine)
            o = dot("btnr,rnh->btnh", o_lat, self.v_b_proj[...], dt)
        o = checkpoint_name(o, "attn_out")
        return project(self, "o_proj", "btnh,nhd->btd", o, dt), entries


def _mm(a, b, dtype, precision=None):
    """2-D matmul in the compute dtype with float32 accumulation, cast back to `dtype`."""
    return jnp.matmul(a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def swiglu(x_NxD, gate_DxF, up_DxF, down_FxD, dtype, precision=None):
    """down(silu(x @ gate) * (x @ up)) over flattened tokens [N, D] -> [N, D] (Shazeer 2020).

    The hand-written backward keeps XLA:CPU from fusing the SiLU gradient into a strided transposed copy;
    `precision` is explicit because that backward is traced outside the caller's precision scope."""
    return _swiglu_fwd(x_NxD, gate_DxF, up_DxF, down_FxD, dtype, precision)[0]


def _swiglu_fwd(x, wg, wu, wd, dtype, precision):
    g = checkpoint_name(_mm(x, wg, dtype, precision), "dot")
    u = checkpoint_name(_mm(x, wu, dtype, precision), "dot")
    return _mm(jax.nn.silu(g) * u, wd, dtype, precision), (x, wg, wu, wd, g, u)


def _swiglu_bwd(dtype, precision, res, dy_NxD):
    x, wg, wu, wd, g, u = res
    mm = functools.partial(_mm, dtype=dtype, precision=precision)
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    s = jax.nn.sigmoid(g32)
    h = (g32 * s * u32).astype(dtype)
    dh = jnp.matmul(dy_NxD.astype(dtype), wd.astype(dtype).T, precision=precision, preferred_element_type=jnp.float32)
    dg = (dh * u32 * s * (1.0 + g32 * (1.0 - s))).astype(dtype)
    du = (dh * g32 * s).astype(dtype)
    x_t = x.astype(dtype).T
    dx = mm(dg, wg.T).astype(jnp.float32) + mm(du, wu.T).astype(jnp.float32)
    return (dx.astype(x.dtype), mm(x_t, dg).astype(wg.dtype), mm(x_t, du).astype(wu.dtype),
            mm(h.T, dy_NxD).astype(wd.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
    """Gated MLP: down(silu(x @ gate) * (x @ up)) (Shazeer 2020, SwiGLU)."""

    def __init__(self, *, d_model: int, mlp_dim: int, dtype, param_dtype, rngs: nnx.Rngs,
                 lora: LoRAConfig | None = None, matmul_precision: str = "default"):
        self.dtype, self.matmul_precision = dtype, matmul_precision
        self.gate_proj = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), param_dtype, fan_in=d_model)
        self.up_proj = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), param_dtype, fan_in=d_model)
        self.down_proj = param(rngs, (mlp_dim, d_model), ("mlp", "embed"), param_dtype, fan_in=mlp_dim)
        add_adapters(self, lora, {"gate_proj": (d_model, mlp_dim), "up_proj": (d_model, mlp_dim),
                                  "down_proj": (mlp_dim, d_model)}, rngs, param_dtype)

    def __call__(self, x_BxTxD):
        if not any(hasattr(self, f"{n}_lora_a") for n in ("gate_proj", "up_proj", "down_proj")):
            # no adapters: the fused SwiGLU with its hand-written backward
            B, T, D = x_BxTxD.shape
            y = swiglu(x_BxTxD.reshape(B * T, D), self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                       self.dtype, lax_precision(self.matmul_precision))
            return y.reshape(B, T, D)
        g = project(self, "gate_proj", "btd,df->btf", x_BxTxD, self.dtype)
        u = project(self, "up_proj", "btd,df->btf", x_BxTxD, self.dtype)
        h = with_logical_constraint(jax.nn.silu(g) * u, ("batch", "length", "mlp"))
        return project(self, "down_proj", "btf,fd->btd", h, self.dtype)
