"""Blockwise self-attention in plain JAX (FlashAttention-2 style): online softmax over key blocks, a hand-written
backward that recomputes scores block by block, and the packed-row mask computed per block from ids.

Dimension legend: B batch, T row length (queries and keys of one row), N query heads, K kv heads, G = N / K query
heads per kv head, H query/key head dim, E value head dim (H for GQA, v_head_dim for MLA), Q query-block length,
C key-block length, I number of query blocks, J number of key blocks.

Source: Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
arXiv:2307.08691 (Algorithm 1 forward, Algorithm 2 backward with D = rowsum(dO * O)). Memory is O(T x block) per
layer instead of O(T^2): scores exist for one [Q, C] block at a time, and the backward keeps only O, the
log-sum-exp and the inputs. Training rows have one source (a packed prompt + completions), so this covers the
gradient path; several sources (shared prefix, KV cache) stay on `attention.multi_source_attention`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.model import attention_kernels as fused_attention
from posttrain.model.attention import NEG_INF, CacheHook, Source, gqa_combine, gqa_logits, multi_source_attention

# Default block lengths (queries and keys) by backend: 128 on the CPU (the fastest of 128 / 256 / 512 there, fwd+bwd);
# elsewhere 512 (a plain-JAX loop pays per-iteration overhead on accelerators, so fewer, larger blocks).
BLOCK = {"cpu": 128}
DEFAULT_BLOCK = 512
# Rows of at least this many tokens take the blockwise path; shorter ones the dense softmax over one [T, T] score
# tensor (on the CPU, fwd+bwd, blockwise is clearly faster from 512 tokens on, for one causal segment and for a
# prompt + 8 completions alike, and not below).
BLOCKWISE_MIN_LEN = 512
_BIG = jnp.iinfo(jnp.int32).max


def default_block() -> int:
    """The block length for the default backend (`BLOCK`, else `DEFAULT_BLOCK`)."""
    return BLOCK.get(jax.default_backend(), DEFAULT_BLOCK)


class RowIds(NamedTuple):
    """The packed-row mask as ids (never a [T, T] mask): int32 segment_BxT (0 = padding) and branch_BxT
    (0 = shared prompt, g = completion g). Rule: `block_mask`."""

    segment_BxT: jax.Array
    branch_BxT: jax.Array


def block_mask(seg_q_BxQ, br_q_BxQ, idx_q_Q, seg_k_BxC, br_k_BxC, idx_k_C) -> jax.Array:
    """bool [B, Q, C]: query i may attend key j iff j <= i (in-row indices idx), both have the same non-zero
    segment id, and j's branch is 0 (the shared prefix) or equal to i's branch."""
    same_seg = (seg_q_BxQ[:, :, None] == seg_k_BxC[:, None, :]) & (seg_k_BxC != 0)[:, None, :]
    branch_ok = (br_k_BxC == 0)[:, None, :] | (br_q_BxQ[:, :, None] == br_k_BxC[:, None, :])
    return (idx_q_Q[:, None] >= idx_k_C[None, :])[None] & same_seg & branch_ok


def _summary(seg_nxBxL, br_nxBxL):
    """Per block and row: (segment min, max, branch min, max) over real tokens; for keys also the min/max of
    non-zero branches and whether a branch-0 key exists. Empty blocks get min > max."""
    real = seg_nxBxL != 0
    lo = lambda x, m: jnp.where(m, x, _BIG).min(-1)
    hi = lambda x, m: jnp.where(m, x, -1).max(-1)
    nz = real & (br_nxBxL != 0)
    return (lo(seg_nxBxL, real), hi(seg_nxBxL, real), lo(br_nxBxL, real), hi(br_nxBxL, real),
            lo(br_nxBxL, nz), hi(br_nxBxL, nz), (real & (br_nxBxL == 0)).any(-1))


def live_blocks(seg_q_IxBxQ, br_q_IxBxQ, seg_k_JxBxC, br_k_JxBxC) -> jax.Array:
    """bool [I, J]: False only where query block i and key block j have no allowed pair in any row (then the
    block is skipped). Conservative: built from per-block intervals of in-row index, segment and branch ids."""
    Q, C = seg_q_IxBxQ.shape[-1], seg_k_JxBxC.shape[-1]
    qs0, qs1, qb0, qb1, _, _, _ = (a[:, None] for a in _summary(seg_q_IxBxQ, br_q_IxBxQ))  # [I, 1, B]
    ks0, ks1, _, _, kn0, kn1, k0 = (a[None] for a in _summary(seg_k_JxBxC, br_k_JxBxC))   # [1, J, B]
    causal = ((jnp.arange(seg_q_IxBxQ.shape[0]) + 1) * Q - 1)[:, None] >= (jnp.arange(seg_k_JxBxC.shape[0]) * C)
    seg = (qs0 <= ks1) & (ks0 <= qs1)
    branch = k0 | ((qb0 <= kn1) & (kn0 <= qb1))
    return causal & (seg & branch).any(-1)


def _scores(q_BxKxGxQxH, k_BxKxCxH, mask_BxQxC, scale, prec):
    s = jnp.einsum("bkgqh,bkch->bkgqc", q_BxKxGxQxH, k_BxKxCxH, precision=prec, preferred_element_type=jnp.float32)
    mask = mask_BxQxC[:, None, None]
    return jnp.where(mask, s * scale, NEG_INF), mask


def _ids(seg_IxBxQ, br_IxBxQ):
    n, _, L = seg_IxBxQ.shape
    return seg_IxBxQ, br_IxBxQ, jnp.arange(n)[:, None] * L + jnp.arange(L)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k, scale, prec):
    return _flash_fwd(q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k, scale, prec)[0]


def _flash_fwd(q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k, scale, prec):
    o, lse, live = _opaque(_forward, scale, prec)(q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k)
    return o, (q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k, live, o, lse)


def _opaque(fn, *static):
    """fn(*arrays, *static) as one unit to JAX's partial evaluation. Inside an outer scan (the layer scan), that
    evaluation hoists every value computable from loop-invariant inputs (the ids: block masks, constant fills) out
    of the loop and stacks it over all [I, J] block pairs: [I, J, B, K, G, Q, C] buffers, the very score-sized
    memory this module avoids. A checkpoint that saves nothing keeps
    the loops whole."""
    return jax.checkpoint(lambda *arrays: fn(*arrays, *static), policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)


def _forward(q_IxBxKxGxQxH, k_JxBxKxCxH, v_JxBxKxCxE, seg_q, br_q, seg_k, br_k, scale, prec):
    """(o [I, B, K, G, Q, E] in q's dtype, float32 log-sum-exp [I, B, K, G, Q], live [I, J])."""
    B, K, G, Q = q_IxBxKxGxQxH.shape[1:5]
    E = v_JxBxKxCxE.shape[-1]
    live_IxJ = live_blocks(seg_q, br_q, seg_k, br_k)

    def q_block(_, xs):
        q, sq, bq, iq, live_J = xs

        def k_block(carry, ys):
            def compute(carry):
                m, l, acc = carry
                s, mask = _scores(q, k, block_mask(sq, bq, iq, sk, bk, ik), scale, prec)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqc,bkce->bkgqe", p.astype(v.dtype), v, precision=prec,
                                preferred_element_type=jnp.float32)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            k, v, sk, bk, ik, live = ys
            return jax.lax.cond(live, compute, lambda c: c, carry), None

        init = (jnp.full((B, K, G, Q), NEG_INF, jnp.float32), jnp.zeros((B, K, G, Q), jnp.float32),
                jnp.zeros((B, K, G, Q, E), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(k_block, init, (k_JxBxKxCxH, v_JxBxKxCxE, *_ids(seg_k, br_k), live_J))
        o = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q_IxBxKxGxQxH.dtype)  # no allowed key: 0
        return None, (o, jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0))

    _, (o, lse) = jax.lax.scan(q_block, None, (q_IxBxKxGxQxH, *_ids(seg_q, br_q), live_IxJ))
    return o, lse, live_IxJ


def _flash_bwd(scale, prec, res, do_IxBxKxGxQxE):
    q_all, k_all, v_all, seg_q, br_q, seg_k, br_k, live_IxJ, o_all, lse_all = res
    dt = q_all.dtype
    delta_all = jnp.sum(do_IxBxKxGxQxE.astype(jnp.float32) * o_all.astype(jnp.float32), -1)  # [I, B, K, G, Q]
    do_all = do_IxBxKxGxQxE.astype(dt)
    mm = functools.partial(jnp.einsum, precision=prec, preferred_element_type=jnp.float32)

    def k_block(dq_acc, xs):
        k, v, sk, bk, ik, live_I = xs

        def q_block(carry, ys):
            def compute(carry):
                dq_acc, dk, dv = carry
                s, mask = _scores(q, k, block_mask(sq, bq, iq, sk, bk, ik), scale, prec)
                p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
                dv = dv + mm("bkgqc,bkgqe->bkce", p.astype(dt), do)
                ds = (p * (mm("bkgqe,bkce->bkgqc", do, v) - delta[..., None]) * scale).astype(dt)
                dq_acc = dq_acc.at[i].add(mm("bkgqc,bkch->bkgqh", ds, k))
                return dq_acc, dk + mm("bkgqc,bkgqh->bkch", ds, q), dv

            i, q, do, lse, delta, sq, bq, iq, live = ys
            return jax.lax.cond(live, compute, lambda c: c, carry), None

        init = (dq_acc, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        xs_q = (jnp.arange(q_all.shape[0]), q_all, do_all, lse_all, delta_all, *_ids(seg_q, br_q), live_I)
        (dq_acc, dk, dv), _ = jax.lax.scan(q_block, init, xs_q)
        return dq_acc, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = jax.lax.scan(k_block, jnp.zeros(q_all.shape, jnp.float32),
                                (k_all, v_all, *_ids(seg_k, br_k), live_IxJ.T))
    return dq.astype(dt), dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, ids: RowIds, scale: float, *, precision=None,
                        block_q: int | None = None, block_k: int | None = None) -> jax.Array:
    """Masked softmax self-attention of one packed row per batch entry, computed block by block.

    Args:
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxE: queries, keys, values (one dtype, the compute dtype); query head n reads
        kv head n // (N / K) (GQA; MLA's expanded form has K = N and E != H).
      ids: `RowIds` of the row; the mask is `block_mask` with in-row indices 0..T-1, evaluated per block.
      scale: multiplier on the logits. precision: a `jax.lax.Precision` or None (ambient); passed explicitly
        because the backward is traced outside the caller's `jax.default_matmul_precision` scope.
      block_q, block_k: block lengths (None: `default_block()`; capped at T); T need not be a multiple (padding
        is masked).
    Returns:
      [B, T, N, E] in q's dtype; softmax in float32; a query with no allowed key gets 0 (and zero gradient).
      Gradients (custom VJP, FlashAttention-2 Algorithm 2) flow to q, k and v.
    Raises:
      ValueError: on inconsistent shapes, N not a multiple of K, or a block length < 1.
    """
    B, T, N, H = q_BxTxNxH.shape
    K, E = k_BxTxKxH.shape[2], v_BxTxKxE.shape[-1]
    if (k_BxTxKxH.shape != (B, T, K, H) or v_BxTxKxE.shape[:3] != (B, T, K) or N % K
            or ids.segment_BxT.shape != (B, T) or ids.branch_BxT.shape != (B, T)):
        raise ValueError(f"blockwise_attention: q {q_BxTxNxH.shape}, k {k_BxTxKxH.shape}, v {v_BxTxKxE.shape}, "
                         f"segment {ids.segment_BxT.shape}, branch {ids.branch_BxT.shape}: expected q [B, T, N, H], "
                         "k [B, T, K, H], v [B, T, K, E], ids [B, T] with N a multiple of K")
    block_q, block_k = (default_block() if b is None else b for b in (block_q, block_k))
    if block_q < 1 or block_k < 1:
        raise ValueError(f"blockwise_attention: block_q={block_q}, block_k={block_k}; expected >= 1")
    Q, C = min(block_q, T), min(block_k, T)
    I, J = -(-T // Q), -(-T // C)

    def blocks(x_BxTx_, n, L):  # [B, T, ...] -> [n, B, L, ...], zero-padded (segment 0: masked)
        x = jnp.pad(x_BxTx_, [(0, 0), (0, n * L - T)] + [(0, 0)] * (x_BxTx_.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, L, *x.shape[2:]), 1, 0)

    q = blocks(q_BxTxNxH.reshape(B, T, K, N // K, H), I, Q).transpose(0, 1, 3, 4, 2, 5)  # [I, B, K, G, Q, H]
    k = blocks(k_BxTxKxH, J, C).transpose(0, 1, 3, 2, 4)  # [J, B, K, C, H]
    v = blocks(v_BxTxKxE.astype(q.dtype), J, C).transpose(0, 1, 3, 2, 4)
    seg, br = ids.segment_BxT.astype(jnp.int32), ids.branch_BxT.astype(jnp.int32)
    o = _flash(q, k.astype(q.dtype), v, blocks(seg, I, Q), blocks(br, I, Q), blocks(seg, J, C), blocks(br, J, C),
               float(scale), precision)
    return o.transpose(1, 0, 4, 2, 3, 5).reshape(B, I * Q, N, E)[:, :T]  # [I, B, K, G, Q, E] -> [B, T, N, E]


def attend(q_BxTxNxH, kv: dict, mask, scale: float, precision=None, extra_sources=(), impl: str = "auto") -> jax.Array:
    """Attention of queries over their own entries kv {"k": [B, T, K, H], "v": [B, T, K, E]} (+ extra sources).

    mask: `RowIds` -> the branch-masked self-attention of `impl` (`fused_attention.resolve_impl` on the mesh's
    platform: splash / Pallas GPU kernels (interpreted off their platform), else `blockwise_attention`; "dense"
    the one-softmax reference; the kernels ignore `precision`); one source only: raises ValueError with
    extra_sources. A bool [B, T, S] array (short rows, `self_mask`; `impl` unused) ->
    the dense multi-source softmax (`attention.multi_source_attention`). A single `attention.CacheHook` source:
    its function computes the attention (the mask unused). Returns [B, T, N, E].
    """
    if len(extra_sources) == 1 and isinstance(extra_sources[0], CacheHook):
        return extra_sources[0].fn(q_BxTxNxH, kv, scale)
    if isinstance(mask, RowIds):
        if extra_sources:
            raise ValueError(f"blockwise attention takes one source; got {len(extra_sources)} extra sources "
                             "(pass a [B, T, S] mask for prefill/decode with cached sources)")
        k, v = kv["k"], kv["v"]
        platform = fused_attention.mesh_platform()
        impl = fused_attention.resolve_impl(impl, platform, q_BxTxNxH.shape[-1], v.shape[-1])
        if impl in ("splash", "pallas_gpu"):
            return fused_attention.fused(impl, q_BxTxNxH, k, v, mask.segment_BxT, mask.branch_BxT, scale, platform)
        if impl == "dense":
            mask = self_mask(mask.segment_BxT, mask.branch_BxT, blockwise=False)
        else:
            return blockwise_attention(q_BxTxNxH, k, v, mask, scale, precision=precision)
    return multi_source_attention(q_BxTxNxH, [*extra_sources, Source(kv, mask)], scale, gqa_logits, gqa_combine)


def self_mask(segment_ids_BxT: jax.Array, branch_ids_BxT: jax.Array, blockwise: bool | None = None):
    """The self-attention mask to hand to the layers: `RowIds` (blockwise path) when `blockwise`, else the dense
    bool [B, T, T] `block_mask` over the whole row. blockwise=None chooses by shape: T >= BLOCKWISE_MIN_LEN."""
    T = segment_ids_BxT.shape[1]
    if blockwise if blockwise is not None else T >= BLOCKWISE_MIN_LEN:
        return RowIds(segment_ids_BxT, branch_ids_BxT)
    idx = jnp.arange(T)
    return block_mask(segment_ids_BxT, branch_ids_BxT, idx, segment_ids_BxT, branch_ids_BxT, idx)
