"""Mixture-of-Experts feed-forward: top-k routing, dropless dispatch (sort + ragged_dot), expert parallelism.

Dimension legend: B batch, T length, D d_model, E experts (El experts local to one 'expert' shard),
F expert MLP hidden, M tokens (B*T), k experts per token.

Routing (pure, `route`): softmax scoring (Mixtral, Qwen3-MoE) or sigmoid scoring (DeepSeek-V3, Kimi K2) with
optional group-limited selection (top-2-sum group scores, DeepSeek-V3), renormalised top-k weights, a routed
scaling factor, and an optional aux-loss-free selection bias (DeepSeek-V3 §2.1.2).
Auxiliary outputs: the Switch-Transformer load-balancing loss E * sum_e f_e * p_e (Fedus et al. 2021), the router
z-loss mean(logsumexp(logits)^2) (Zoph et al. 2022, ST-MoE), and the per-expert load (fraction of assignments).

Dispatch is dropless: assignments are sorted by expert and each expert's contiguous rows go through one
`jax.lax.ragged_dot`. Under a mesh with an 'expert' axis, the dispatch runs in `shard_map`: tokens are
all-gathered across the expert shards, each shard computes its own experts' rows, and a reduce-scatter returns
each token's combined output to its shard (tensor-sharded expert MLPs are psum-reduced as well).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from posttrain import mesh as mesh_lib
from posttrain.model.config import MoEConfig
from posttrain.model.layers import MLP, dot, param
from posttrain.partitioning import active_mesh, current_rules


class ExpertBias(nnx.Variable):
    """Aux-loss-free routing bias [E]: not a Param, so optimisers never touch it; the train step updates it."""


def route(logits_MxE: jax.Array, bias_E: jax.Array | None, *, k: int, scoring: str, norm_topk_prob: bool,
          routed_scaling_factor: float, num_groups: int = 1, topk_groups: int = 1):
    """Top-k routing. Returns (weights_Mxk f32, experts_Mxk int32, probs_MxE f32 used by the balance loss).

    The bias (if any) only affects which experts are *selected*; weights come from the unbiased scores.
    """
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


def expert_ffn(x_MxD, experts_Mxk, weights_Mxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, dtype, expert_offset=0):
    """Dropless gated-MLP over the experts held locally (ids [offset, offset + El)); other assignments add 0."""
    M, k = experts_Mxk.shape
    El = w_gate_ExDxF.shape[0]
    local_id = experts_Mxk.reshape(-1) - expert_offset
    is_local = (local_id >= 0) & (local_id < El)
    key = jnp.where(is_local, local_id, El)  # non-local rows sort last, outside every group
    order = jnp.argsort(key, stable=True)
    token = order // k
    sizes = jnp.bincount(key, length=El + 1)[:El].astype(jnp.int32)
    xs = x_MxD[token].astype(dtype)
    # matmul outputs in the compute dtype, named "dot" for the "dots" remat policy (like `layers.dot`)
    g = checkpoint_name(jax.lax.ragged_dot(xs, w_gate_ExDxF.astype(dtype), sizes,
                                           preferred_element_type=jnp.float32).astype(dtype), "dot")
    u = checkpoint_name(jax.lax.ragged_dot(xs, w_up_ExDxF.astype(dtype), sizes,
                                           preferred_element_type=jnp.float32).astype(dtype), "dot")
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dtype)
    y = jax.lax.ragged_dot(h, w_down_ExFxD.astype(dtype), sizes, preferred_element_type=jnp.float32)
    w = jnp.where(is_local, weights_Mxk.reshape(-1), 0.0)[order]
    return jnp.zeros((M, x_MxD.shape[-1]), jnp.float32).at[token].add(y * w[:, None])


def _axes(spec_entry) -> tuple[str, ...]:
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def dispatch(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype):
    """`expert_ffn` over all experts; under an active mesh, expert-parallel in shard_map (see module doc)."""
    mesh = active_mesh()
    if mesh is None:
        return expert_ffn(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype)
    rules = current_rules()
    ex_axes = _axes(mesh_lib.logical_to_spec(("exp",), rules)[0])
    mlp_axes = _axes(mesh_lib.logical_to_spec(("exp_mlp",), rules)[0])
    tok_axes = _axes(mesh_lib.logical_to_spec(("batch",), rules)[0])
    shards = 1
    for a in tok_axes:
        shards *= mesh.shape[a]
    if x_MxD.shape[0] % shards:
        tok_axes = ()  # e.g. a decode batch smaller than the mesh: tokens replicated
    gather = tuple(a for a in ex_axes if a in tok_axes)
    psum_only = tuple(a for a in ex_axes if a not in tok_axes) + mlp_axes
    tok = PartitionSpec(tok_axes or None, None)
    ex = tuple(ex_axes) or None
    mlp = tuple(mlp_axes) or None
    E = w_gate.shape[0]

    def local(x, e, w, wg, wu, wd):
        if gather:
            x, e, w = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, e, w))
        offset = 0
        if ex_axes:
            offset = jax.lax.axis_index(ex_axes) * (E // _size(mesh, ex_axes))
        y = expert_ffn(x, e, w, wg, wu, wd, dtype, expert_offset=offset)
        if psum_only:
            y = jax.lax.psum(y, psum_only)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return y

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, PartitionSpec(ex, None, mlp),
                                                   PartitionSpec(ex, None, mlp), PartitionSpec(ex, mlp, None)),
                       out_specs=tok, check_vma=False)
    return fn(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down)


def _size(mesh, axes):
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


class MoE(nnx.Module):
    """Routed experts (+ optional always-on shared experts). Returns (y_BxTxD, aux dict)."""

    def __init__(self, *, d_model: int, moe: MoEConfig, dtype, param_dtype, rngs: nnx.Rngs, lora=None,
                 matmul_precision: str = "default"):
        D, E, F = d_model, moe.num_experts, moe.expert_mlp_dim
        self.dtype = dtype
        self.k, self.scoring, self.norm_topk_prob = moe.num_experts_per_tok, moe.scoring, moe.norm_topk_prob
        self.scaling, self.num_groups, self.topk_groups = moe.routed_scaling_factor, moe.num_groups, moe.topk_groups
        self.router = param(rngs, (D, E), ("embed", None), param_dtype, fan_in=D)
        self.gate_proj = param(rngs, (E, D, F), ("exp", "embed", "exp_mlp"), param_dtype, fan_in=D)
        self.up_proj = param(rngs, (E, D, F), ("exp", "embed", "exp_mlp"), param_dtype, fan_in=D)
        self.down_proj = param(rngs, (E, F, D), ("exp", "exp_mlp", "embed"), param_dtype, fan_in=F)
        self.score_bias = ExpertBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,)) if moe.score_bias else None
        self.shared = (MLP(d_model=D, mlp_dim=F * moe.num_shared_experts, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, lora=lora, matmul_precision=matmul_precision)
                       if moe.num_shared_experts else None)

    def __call__(self, x_BxTxD, valid_BxT):
        B, T, D = x_BxTxD.shape
        x = x_BxTxD.reshape(B * T, D)
        logits = dot("md,de->me", x.astype(jnp.float32), self.router[...].astype(jnp.float32), jnp.float32)
        bias = None if self.score_bias is None else self.score_bias[...]
        weights, experts, probs = route(logits, bias, k=self.k, scoring=self.scoring,
                                        norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.scaling,
                                        num_groups=self.num_groups, topk_groups=self.topk_groups)
        y = dispatch(x, experts, weights, self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.dtype)
        y = y.reshape(B, T, D).astype(x_BxTxD.dtype)
        if self.shared is not None:
            y = y + self.shared(x_BxTxD)
        return y, router_aux(logits, probs, experts, valid_BxT.reshape(-1))
