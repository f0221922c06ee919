"""Mixture-of-Experts feed-forward: top-k routing, grouped-matmul experts, expert-parallel dispatch.

Design: docs/moe.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from posttrain.infra import mesh as mesh_lib
from posttrain.model import expert_parallel
from posttrain.model import gmm
from posttrain.model.config import MoEConfig
from posttrain.model.layers import MLP, dot, param
from posttrain.infra.partitioning import active_mesh, current_rules


class ExpertBias(nnx.Variable):
    """Aux-loss-free routing bias [E]: not a Param, so optimisers never touch it; the train step updates it."""


def route(logits_MxE: jax.Array, bias_E: jax.Array | None, *, k: int, scoring: str, norm_topk_prob: bool,
          routed_scaling_factor: float, num_groups: int = 1, topk_groups: int = 1, replay_Mxk=None):
    """Top-k routing: (weights_Mxk f32, experts_Mxk int32, probs_MxE f32 for the balance loss).

    The bias changes the selection, not the weights. replay_Mxk: int, where >= 0 that expert is selected instead."""
    logits = logits_MxE.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias_E is None else scores + bias_E.astype(jnp.float32)
    M, E = choice.shape
    if num_groups > 1:
        grouped = choice.reshape(M, num_groups, E // num_groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_scores, topk_groups)
        keep = jnp.zeros((M, num_groups), bool).at[jnp.arange(M)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, E // num_groups, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    if replay_Mxk is not None:
        experts = jnp.where(replay_Mxk >= 0, replay_Mxk.astype(experts.dtype), experts)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * routed_scaling_factor
    probs = scores if scoring == "softmax" else scores / (scores.sum(-1, keepdims=True) + 1e-20)
    return weights, experts.astype(jnp.int32), probs


def router_aux(logits_MxE, probs_MxE, experts_Mxk, valid_M):
    """Balance loss, z-loss and per-expert load fraction [E] over valid tokens (all float32)."""
    E = probs_MxE.shape[-1]
    v = valid_M.astype(jnp.float32)
    n = jnp.maximum(v.sum(), 1.0)
    counts = (jax.nn.one_hot(experts_Mxk, E, dtype=jnp.float32) * v[:, None, None]).sum((0, 1))
    load = counts / jnp.maximum(counts.sum(), 1.0)
    mean_prob = (probs_MxE * v[:, None]).sum(0) / n
    z = jax.nn.logsumexp(logits_MxE.astype(jnp.float32), axis=-1)
    return {"load_balance_loss": E * jnp.sum(load * mean_prob), "router_z_loss": (v * z * z).sum() / n,
            "expert_load": load}


def expert_capacity(rows: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert of the capacity layout: ceil(capacity_factor * rows / num_experts), rows = tokens * k."""
    return max(1, math.ceil(capacity_factor * rows / num_experts))


def expert_keys(experts_Mxk, num_local: int, expert_offset=0, capacity: int | None = None):
    """Local group of each assignment row (token-major [M*k]): its local expert, else `num_local` (computed nowhere).

    An expert keeps its first `capacity` rows in token order. Returns (keys int32, int32 count of rows dropped)."""
    local_id = experts_Mxk.reshape(-1) - expert_offset
    is_local = (local_id >= 0) & (local_id < num_local)
    key = jnp.where(is_local, local_id, num_local).astype(jnp.int32)
    if capacity is None:
        return key, jnp.zeros((), jnp.int32)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_local + 1)
    n = key.shape[0]
    sorted_rank = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[key[order]]
    rank = jnp.zeros((n,), jnp.int32).at[order].set(sorted_rank)  # 0-based position within its expert
    keep = is_local & (rank < capacity)
    return jnp.where(keep, key, num_local), jnp.sum(is_local & ~keep).astype(jnp.int32)


def expert_ffn(x_MxD, experts_Mxk, weights_Mxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, dtype, expert_offset=0, *,
               impl: str = "auto", capacity_factor: float | None = None, precision=None, platform: str | None = None):
    """y_MxD float32 = sum_k weight * expert_k(x) over the local experts (ids [offset, offset + El)); others add 0.

    capacity_factor None: dropless, else at most `expert_capacity(M * k, El, capacity_factor)` rows per expert."""
    M, k = experts_Mxk.shape
    El = w_gate_ExDxF.shape[0]
    capacity = None if capacity_factor is None else expert_capacity(M * k, El, capacity_factor)
    impl = "capacity" if capacity is not None else impl
    key, _ = expert_keys(experts_Mxk, El, expert_offset, capacity)
    order = jnp.argsort(key, stable=True)  # rows computed nowhere sort last, outside every group
    token = order // k
    sizes = jnp.bincount(key, length=El + 1)[:El].astype(jnp.int32)
    xs = x_MxD[token].astype(dtype)
    gmm_kw = dict(impl=impl, capacity=capacity, precision=precision, platform=platform)

    def mm(a, w):
        return gmm.grouped_matmul(a, w.astype(dtype), sizes, out_dtype=dtype, **gmm_kw)

    g = checkpoint_name(mm(xs, w_gate_ExDxF), "dot")
    u = checkpoint_name(mm(xs, w_up_ExDxF), "dot")
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dtype)
    y = gmm.grouped_matmul(h, w_down_ExFxD.astype(dtype), sizes, **gmm_kw)
    w = jnp.where(key < El, weights_Mxk.reshape(-1), 0.0)[order]
    return jnp.zeros((M, x_MxD.shape[-1]), jnp.float32).at[token].add(y * w[:, None])


def _axes(spec_entry) -> tuple[str, ...]:
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


EP_IMPLS = ("auto", "all_to_all", "ragged", "all_gather")


def _platform(mesh) -> str:
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def dispatch(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype, ep_capacity_factor: float = 2.0,
             ep_impl: str = "auto", *, ffn_kw: dict | None = None, _ragged_impl=None):
    """`expert_ffn` over all experts; under an active mesh, expert-parallel in shard_map (docs/moe.md).

    Args:
      ep_capacity_factor: cf; C = ceil(cf * m * k / S) rows per (source, destination) pair (ragged: ceil(cf * m * k)).
      ep_impl: one of EP_IMPLS; "auto": ragged on a TPU/GPU mesh, else all_to_all; "ragged" does not run on CPU.
      ffn_kw: `expert_ffn` keywords (impl, capacity_factor).
    Returns:
      (y_MxD float32, the fraction of the M*k assignments dropped, float32 scalar).
    """
    if ep_impl not in EP_IMPLS:
        raise ValueError(f"ep_impl={ep_impl!r}; expected one of {EP_IMPLS}")
    zero = jnp.zeros((), jnp.float32)
    mesh = active_mesh()
    ffn = functools.partial(expert_ffn, **(ffn_kw or {}), platform=None if mesh is None else _platform(mesh))
    if mesh is None:
        return ffn(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype), zero
    rules = current_rules()
    ex_axes = _axes(mesh_lib.logical_to_spec(("exp",), rules)[0])
    mlp_axes = _axes(mesh_lib.logical_to_spec(("exp_mlp",), rules)[0])
    tok_axes = _axes(mesh_lib.logical_to_spec(("batch",), rules)[0])
    embed_axes = tuple(a for a in _axes(mesh_lib.logical_to_spec(("embed",), rules)[0])
                       if a not in ex_axes and a not in mlp_axes)  # the weights' FSDP split of D
    size = lambda axes: expert_parallel.mesh_size(mesh, axes)
    M = x_MxD.shape[0]
    if M % size(tok_axes):
        tok_axes = ()  # e.g. a decode batch smaller than the mesh: tokens replicated
    outside = tuple(a for a in ex_axes if a not in tok_axes)  # expert axes the tokens are replicated over
    args = (x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype)
    if ep_impl == "all_gather" or size(ex_axes) == 1 or M % (size(tok_axes) * size(outside)):
        # nothing to exchange (one expert shard), or replicated tokens that do not split over the expert shards
        # (decode): the exact, dropless all-gather / psum form
        return expert_parallel.dispatch_gather(ffn, *args, mesh, ex_axes, mlp_axes, tok_axes, embed_axes), zero
    ragged = ep_impl == "ragged" or (ep_impl == "auto" and _platform(mesh) in ("tpu", "gpu"))
    return expert_parallel.dispatch_all_to_all(ffn, *args, float(ep_capacity_factor), mesh, ex_axes, mlp_axes,
                                      tok_axes, ragged=ragged, ragged_impl=_ragged_impl, embed_axes=embed_axes)


class MoE(nnx.Module):
    """Routed experts plus optional always-on shared experts; calls return (y_BxTxD, aux dict)."""

    def __init__(self, *, d_model: int, moe: MoEConfig, dtype, param_dtype, rngs: nnx.Rngs, lora=None,
                 matmul_precision: str = "default", gmm_impl: str = "auto", capacity_factor: float = 0.0,
                 ep_capacity_factor: float = 2.0):
        """gmm_impl, capacity_factor, ep_capacity_factor: `ModelConfig.moe_*`."""
        D, E, F = d_model, moe.num_experts, moe.expert_mlp_dim
        self.dtype = dtype
        self.k, self.scoring, self.norm_topk_prob = moe.num_experts_per_tok, moe.scoring, moe.norm_topk_prob
        self.scaling, self.num_groups, self.topk_groups = moe.routed_scaling_factor, moe.num_groups, moe.topk_groups
        self.gmm_impl, self.capacity_factor = gmm_impl, float(capacity_factor) or None
        self.ep_capacity_factor = float(ep_capacity_factor)
        self.router = param(rngs, (D, E), ("embed", None), param_dtype, fan_in=D)
        self.gate_proj = param(rngs, (E, D, F), ("exp", "embed", "exp_mlp"), param_dtype, fan_in=D)
        self.up_proj = param(rngs, (E, D, F), ("exp", "embed", "exp_mlp"), param_dtype, fan_in=D)
        self.down_proj = param(rngs, (E, F, D), ("exp", "exp_mlp", "embed"), param_dtype, fan_in=F)
        self.score_bias = ExpertBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,)) if moe.score_bias else None
        self.shared = (MLP(d_model=D, mlp_dim=F * moe.num_shared_experts, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, lora=lora, matmul_precision=matmul_precision)
                       if moe.num_shared_experts else None)

    def __call__(self, x_BxTxD, valid_BxT, replay_BxTxk=None):
        """(y_BxTxD, aux): `router_aux`'s entries, ep_dropped_frac and "routed_experts" int32 [B, T, k].

        replay_BxTxk: experts to select per token (-1: route normally) or None."""
        B, T, D = x_BxTxD.shape
        x = x_BxTxD.reshape(B * T, D)
        logits = dot("md,de->me", x.astype(jnp.float32), self.router[...].astype(jnp.float32), jnp.float32)
        bias = None if self.score_bias is None else self.score_bias[...]
        replay = None if replay_BxTxk is None else replay_BxTxk.reshape(B * T, self.k)
        weights, experts, probs = route(logits, bias, k=self.k, scoring=self.scoring,
                                        norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.scaling,
                                        num_groups=self.num_groups, topk_groups=self.topk_groups,
                                        replay_Mxk=replay)
        y, dropped = dispatch(x, experts, weights, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                              self.dtype, ep_capacity_factor=self.ep_capacity_factor,
                              ffn_kw=dict(impl=self.gmm_impl, capacity_factor=self.capacity_factor))
        y = y.reshape(B, T, D).astype(x_BxTxD.dtype)
        if self.shared is not None:
            y = y + self.shared(x_BxTxD)
        return y, dict(router_aux(logits, probs, experts, valid_BxT.reshape(-1)), ep_dropped_frac=dropped,
                       routed_experts=experts.reshape(B, T, self.k))
