"""Expert-parallel MoE dispatch inside `jax.shard_map`: the all-to-all exchanges and the all-gather form.

Dimension legend: S expert shards (the size of the 'exp' mesh axes), El = E/S experts per shard, m tokens of one
source shard, k experts per token, n = m*k assignment rows, D d_model, C fixed send capacity per (source,
destination) pair, R ragged receive rows per expert shard.

`posttrain.model.moe.dispatch` picks the form (the policy, overflow included, is in moe.py's module doc):
  fixed    `jax.lax.all_to_all` of [S*C, D] buffers, C = ceil(cf * n / S); a source keeps its first C rows (token
           order) for each destination and drops the rest. Runs everywhere (XLA:CPU included).
  ragged   `jax.lax.ragged_all_to_all` (TPU/GPU only; XLA:CPU does not implement it): each source sends exactly its
           rows, sorted by expert; every shard all-gathers the [S, S] row counts, so all agree on where each chunk
           lands. An expert shard receives at most R = ceil(cf * n) rows in total (the fixed form's S*C): sources
           fill it in shard order and rows past R are dropped. Capacity is pooled over the sources, so it drops
           less than `fixed` under skew; cf >= S never drops. Compile-checked for TPU v5p only (no run).
  gather   every expert shard gathers all tokens of its group, computes its own experts' rows and reduce-scatters
           (psum where tokens are replicated): dropless, memory and traffic grow with S.
The expert MLP itself is the `ffn` argument (`moe.expert_ffn`, called with k = 1 rows: received rows, their expert
id, weight 1; padding has expert id -1 and weight 0).
"""
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
    """FSDP inside shard_map: the expert weights arrive split over `embed_axes` on D (their parameter sharding)
    and are cast to the compute dtype before the all-gather, so each layer gathers [El, D, F] in bf16 (not
    float32), and the gradient leaves through the all-gather's transpose, a reduce-scatter in the compute dtype.
    Entering shard_map with D whole would make XLA gather float32 weights outside it and sum each device's full
    float32 [El, D, F] weight gradient with a psum inside (three float32 [El, D, F] buffers per layer)."""
    cast = [w.astype(dtype) for w in (wg, wu, wd)]
    if not embed_axes:
        return cast
    wg, wu, wd = cast
    return (jax.lax.all_gather(wg, embed_axes, axis=1, tiled=True),
            jax.lax.all_gather(wu, embed_axes, axis=1, tiled=True),
            jax.lax.all_gather(wd, embed_axes, axis=2, tiled=True))


def dispatch_gather(ffn, x_MxD, experts_Mxk, weights_Mxk, w_gate, w_up, w_down, dtype, mesh, ex_axes, mlp_axes,
                    tok_axes, embed_axes=()):
    """All-gather form (module doc). x_MxD [M, D], experts/weights [M, k]; weights split on D over embed_axes
    (`gather_weights`); returns y_MxD float32."""
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
    """All-to-all forms (module doc), tokens split over `tok_axes`. Expert axes the tokens are replicated over
    (not in tok_axes) first split the tokens further, so every token is computed once, and all-gather the outputs
    at the end: the alternative psum form runs every token's local-expert rows on every expert shard ([m*k, D]
    expert rows and an [m, D] float32 all-reduce per device) against [~cf*m*k/S', D] rows and an [m, D]
    all-gather here: lower memory and traffic. Needs M divisible by the token shards times those axes.
    ragged_impl: a stand-in for `jax.lax.ragged_all_to_all` (tests on CPU). embed_axes: the weights' D split
    (`gather_weights`). Returns (y_MxD float32, dropped
    fraction float32 scalar)."""
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
    """Fixed-capacity send layout. dest_n int32 [n]: destination shard of each assignment row.

    Rows are stably sorted by destination; the first `capacity` rows (in row order) for each destination fill
    slots [dest * capacity, (dest + 1) * capacity) of the [S*C] send buffer, the rest are dropped.
    Returns (src_SC int32: the row in each slot, n for an empty slot; slot_n int32: each row's slot, S*C when
    dropped).
    """
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
    """sum_k weight * row per token, float32 [m, D], from the returned rows in token-major order [m*k, D]
    (compute dtype). One fused convert-multiply-reduce: no float32 [m*k, D] copy; dropped rows (keep_n False)
    add 0."""
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
    """One source shard's tokens to the expert shards and back through fixed [S*C, D] buffers (in shard_map).

    x_mxD: this shard's m tokens; e_mxk / w_mxk: their global expert ids / routing weights.
    Returns (y_mxD float32 combined with the routing weights, dropped row count float32 scalar).
    """
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
    """Who sends what where. counts_SxS[i, j]: rows source i has for destination j; each destination takes at most
    `capacity` rows, sources in shard order. Returns (kept [S, S] rows actually sent, dst_off [S, S]: offset of
    chunk i->j in j's receive buffer, src_off [S, S]: offset of chunk i->j in i's expert-sorted rows)."""
    dst_off = jnp.cumsum(counts_SxS, axis=0) - counts_SxS
    kept = jnp.clip(capacity - dst_off, 0, counts_SxS)
    src_off = jnp.cumsum(counts_SxS, axis=1) - counts_SxS
    return kept, dst_off, src_off


def exchange_ragged(ffn, x_mxD, e_mxk, w_mxk, wg, wu, wd, dtype, capacity_factor, ex_axes, mlp_axes, S, El,
                    impl=None):
    """`exchange_fixed` with `jax.lax.ragged_all_to_all` (or `impl`, same signature): sources send exactly their
    rows; an expert shard receives at most R = ceil(cf * n) rows. Same arguments and returns."""
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
