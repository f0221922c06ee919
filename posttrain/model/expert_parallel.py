"""Expert-parallel MoE dispatch inside `jax.shard_map`: the all-to-all exchanges and the all-gather form.

`posttrain.model.moe.dispatch` picks the form (docs/moe.md). Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def mesh_size(mesh, axes) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def _specs(ex_axes, mlp_axes, tok_axes, embed_axes=()):
    tok = PartitionSpec(tok_axes or None, None)
    ex, mlp, emb = tuple(ex_axes) or None, tuple(mlp_axes) or None, tuple(embed_axes) or None
    return tok, (tok, tok, tok, PartitionSpec(ex, emb, mlp), PartitionSpec(ex, emb, mlp),
                 PartitionSpec(ex, mlp, emb))


def gather_weights(wg, wu, wd, dtype, embed_axes):
    """The expert weights cast to `dtype`, then all-gathered on D over `embed_axes` (FSDP; why: docs/moe.md)."""
    cast = [w.astype(dtype) for w in (wg, wu, wd)]
    if not embed_axes:
        return cast
    wg, wu, wd = cast
    return (jax.lax.all_gather(wg, embed_axes, axis=1, tiled=True),
            jax.lax.all_gather(wu, embed_axes, axis=1, tiled=True),
            jax.lax.all_gather(wd, embed_axes, axis=2, tiled=True))


def dispatch_gather(ffn, x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype, mesh, ex_axes, mlp_axes,
                    tok_axes, embed_axes=()):
    """The dropless all-gather form of `posttrain.model.moe.dispatch`; returns y_MxD float32."""
    gather = tuple(a for a in ex_axes if a in tok_axes)
    psum_only = tuple(a for a in ex_axes if a not in tok_axes) + tuple(mlp_axes)
    El = w_gate.shape[0] // mesh_size(mesh, ex_axes)

    def local(x, e, w, wg, wu, wd):
        wg, wu, wd = gather_weights(wg, wu, wd, dtype, embed_axes)
        if gather:
            x, e, w = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, e, w))
        offset = jax.lax.axis_index(ex_axes) * El if ex_axes else 0
        y = ffn(x, e, w, wg, wu, wd, dtype, expert_offset=offset)
        if psum_only:
            y = jax.lax.psum(y, psum_only)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return y

    tok, in_specs = _specs(ex_axes, mlp_axes, tok_axes, embed_axes)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tok, check_vma=False)
    return fn(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down)


def dispatch_all_to_all(ffn, x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype, capacity_factor: float,
                        mesh, ex_axes, mlp_axes, tok_axes, ragged: bool = False, ragged_impl=None, embed_axes=()):
    """The fixed or ragged all-to-all form of `posttrain.model.moe.dispatch`: (y_MxD float32, dropped fraction).

    M must divide by the token shards times the expert shards the tokens are replicated over.
    ragged_impl: a CPU stand-in for `jax.lax.ragged_all_to_all`."""
    S = mesh_size(mesh, ex_axes)
    El = w_gate.shape[0] // S
    outside = tuple(a for a in ex_axes if a not in tok_axes)
    count_axes = tuple(tok_axes) + outside  # axes over which shard_map instances hold distinct tokens

    def local(x, e, w, wg, wu, wd):
        wg, wu, wd = gather_weights(wg, wu, wd, dtype, embed_axes)
        if outside:
            mm = x.shape[0] // mesh_size(mesh, outside)
            start = jax.lax.axis_index(outside) * mm
            x, e, w = (jax.lax.dynamic_slice_in_dim(a, start, mm, axis=0) for a in (x, e, w))
        args = (ffn, x, e, w, wg, wu, wd, dtype, capacity_factor, ex_axes, mlp_axes, S, El)
        y, dropped = exchange_ragged(*args, impl=ragged_impl) if ragged else exchange_fixed(*args)
        if outside:
            y = jax.lax.all_gather(y, outside, axis=0, tiled=True)
        total = jnp.asarray(e.size, jnp.float32)
        if count_axes:
            dropped, total = jax.lax.psum(dropped, count_axes), jax.lax.psum(total, count_axes)
        return y, dropped / total

    tok, in_specs = _specs(ex_axes, mlp_axes, tok_axes, embed_axes)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(tok, PartitionSpec()), check_vma=False)
    return fn(x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down)


def send_slots(dest_n, num_shards: int, capacity: int):
    """Fixed-capacity send layout: the first `capacity` rows per destination shard (int32 dest_n [n]) fill its slots.

    Returns int32 (src_SC: each slot's row, n if empty; slot_n: each row's slot, S*C if dropped)."""
    n = dest_n.shape[0]
    order = jnp.argsort(dest_n, stable=True)
    dest_sorted = dest_n[order]
    counts = jnp.bincount(dest_n, length=num_shards)
    rank = jnp.arange(n) - (jnp.cumsum(counts) - counts)[dest_sorted]
    kept_sorted = rank < capacity
    slot = jnp.where(kept_sorted, dest_sorted * capacity + rank, num_shards * capacity)
    src = jnp.full((num_shards * capacity,), n, jnp.int32).at[slot].set(order.astype(jnp.int32), mode="drop")
    return src, jnp.zeros((n,), jnp.int32).at[order].set(slot.astype(jnp.int32))


def combine(rows_nxD, weights_mxk, keep_n):
    """float32 [m, D]: each token's k returned rows [m*k, D] summed with their weights; dropped rows add 0."""
    m, k = weights_mxk.shape
    w = jnp.where(keep_n.reshape(m, k), weights_mxk, 0.0).astype(jnp.float32)
    return (rows_nxD.reshape(m, k, -1).astype(jnp.float32) * w[..., None]).sum(1)


def _expert_side(ffn, recv_x, recv_e, wg, wu, wd, dtype, ex_axes, mlp_axes, El):
    """Local experts on received rows (expert id -1: padding, adds 0); [rows, D] in the compute dtype."""
    offset = jax.lax.axis_index(ex_axes) * El
    y = ffn(recv_x, recv_e[:, None], (recv_e >= 0).astype(jnp.float32)[:, None], wg, wu, wd, dtype,
            expert_offset=offset)
    if mlp_axes:
        y = jax.lax.psum(y, mlp_axes)  # tensor-sharded expert MLP: partial sums over F
    return y.astype(dtype)


def exchange_fixed(ffn, x_mxD, e_mxk, w_mxk, wg, wu, wd, dtype, capacity_factor, ex_axes, mlp_axes, S, El):
    """One source shard's rows to the expert shards and back via [S*C, D] buffers: (y_mxD float32, dropped count)."""
    m, k = e_mxk.shape
    n = m * k
    C = min(n, max(1, math.ceil(capacity_factor * n / S)))
    e_n = e_mxk.reshape(n)
    src_SC, slot_n = send_slots(e_n // El, S, C)
    filled = src_SC < n
    row = jnp.minimum(src_SC, n - 1)
    tok = row // k
    send_x = jnp.where(filled[:, None], x_mxD[tok].astype(dtype), 0)  # [S*C, D]: chunk j goes to expert shard j
    send_e = jnp.where(filled, e_n[row], -1)
    recv_x = jax.lax.all_to_all(send_x, ex_axes, 0, 0, tiled=True)  # chunk i came from source shard i
    recv_e = jax.lax.all_to_all(send_e, ex_axes, 0, 0, tiled=True)
    y = _expert_side(ffn, recv_x, recv_e, wg, wu, wd, dtype, ex_axes, mlp_axes, El)
    back = jax.lax.all_to_all(y, ex_axes, 0, 0, tiled=True)  # slot-aligned with send_x
    kept_n = slot_n < S * C
    out = combine(back[jnp.minimum(slot_n, S * C - 1)], w_mxk, kept_n)
    return out, (n - kept_n.sum()).astype(jnp.float32)


def ragged_plan(counts_SxS, capacity: int):
    """(kept, dst_off, src_off) [S, S]: rows i sends j under `capacity`, their offset at j and in i's sorted rows."""
    dst_off = jnp.cumsum(counts_SxS, axis=0) - counts_SxS
    kept = jnp.clip(capacity - dst_off, 0, counts_SxS)
    src_off = jnp.cumsum(counts_SxS, axis=1) - counts_SxS
    return kept, dst_off, src_off


def exchange_ragged(ffn, x_mxD, e_mxk, w_mxk, wg, wu, wd, dtype, capacity_factor, ex_axes, mlp_axes, S, El,
                    impl=None):
    """`exchange_fixed` over `jax.lax.ragged_all_to_all` (or `impl`): at most R = ceil(cf * n) rows per shard."""
    a2a = impl or jax.lax.ragged_all_to_all
    m, k = e_mxk.shape
    n = m * k
    R = min(S * n, max(1, math.ceil(capacity_factor * n)))
    e_n = e_mxk.reshape(n)
    order = jnp.argsort(e_n, stable=True)  # by expert, hence by destination shard
    e_sorted = e_n[order]
    dest_sorted = e_sorted // El
    counts = jnp.bincount(e_n // El, length=S).astype(jnp.int32)
    kept, dst_off, src_off = ragged_plan(jax.lax.all_gather(counts, ex_axes, axis=0, tiled=False), R)
    me = jax.lax.axis_index(ex_axes)
    fwd = (src_off[me], kept[me], dst_off[me], kept[:, me])  # input offsets, send sizes, output offsets, recv
    recv_x = a2a(x_mxD[order // k].astype(dtype), jnp.zeros((R, x_mxD.shape[-1]), dtype), *fwd, axis_name=ex_axes)
    recv_e = a2a(e_sorted, jnp.full((R,), -1, e_sorted.dtype), *fwd, axis_name=ex_axes)
    y = _expert_side(ffn, recv_x, recv_e, wg, wu, wd, dtype, ex_axes, mlp_axes, El)
    bwd = (dst_off[:, me], kept[:, me], src_off[:, me], kept[me])
    back = a2a(y, jnp.zeros((n, y.shape[-1]), dtype), *bwd, axis_name=ex_axes)  # aligned with the sorted rows
    rank = jnp.arange(n, dtype=jnp.int32) - src_off[me][dest_sorted]
    position = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))  # row -> sorted index
    kept_n = (rank < kept[me][dest_sorted])[position]
    out = combine(back[position], w_mxk, kept_n)
    return out, (n - kept[me].sum()).astype(jnp.float32)
