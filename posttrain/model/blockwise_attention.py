"""Blockwise self-attention in plain JAX over packed rows, with the mask computed per block from ids.

FlashAttention-2 (Dao 2023, arXiv:2307.08691); docs/attention.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.model import attention_kernels
from posttrain.model.attention import NEG_INF, CacheHook, Source, gqa_combine, gqa_logits, multi_source_attention

# Block lengths by backend: a plain-JAX loop pays per-iteration overhead on accelerators, so fewer, larger blocks.
BLOCK = {"cpu": 128}
DEFAULT_BLOCK = 512
BLOCKWISE_MIN_LEN = 512  # shorter rows take the dense softmax (on the CPU blockwise is faster from 512 tokens on)
_BIG = jnp.iinfo(jnp.int32).max


def default_block() -> int:
    """The block length for the default backend (`BLOCK`, else `DEFAULT_BLOCK`)."""
    return BLOCK.get(jax.default_backend(), DEFAULT_BLOCK)


class RowIds(NamedTuple):
    """The packed-row mask as ids: int32 segment_BxT (0 = padding), branch_BxT (0 = shared prompt); `block_mask`."""

    segment_BxT: jax.Array
    branch_BxT: jax.Array


def block_mask(seg_q_BxQ, br_q_BxQ, idx_q_Q, seg_k_BxC, br_k_BxC, idx_k_C) -> jax.Array:
    """bool [B, Q, C]: key j <= query i (in-row idx), same non-zero segment, j's branch 0 (shared) or i's."""
    same_seg = (seg_q_BxQ[:, :, None] == seg_k_BxC[:, None, :]) & (seg_k_BxC != 0)[:, None, :]
    branch_ok = (br_k_BxC == 0)[:, None, :] | (br_q_BxQ[:, :, None] == br_k_BxC[:, None, :])
    return (idx_q_Q[:, None] >= idx_k_C[None, :])[None] & same_seg & branch_ok


def _summary(seg_nxBxL, br_nxBxL):
    """Per block and row: segment and branch min/max, non-zero branch min/max, any branch 0; empty: min > max."""
    real = seg_nxBxL != 0
    lo = lambda x, m: jnp.where(m, x, _BIG).min(-1)
    hi = lambda x, m: jnp.where(m, x, -1).max(-1)
    nz = real & (br_nxBxL != 0)
    return (lo(seg_nxBxL, real), hi(seg_nxBxL, real), lo(br_nxBxL, real), hi(br_nxBxL, real),
            lo(br_nxBxL, nz), hi(br_nxBxL, nz), (real & (br_nxBxL == 0)).any(-1))


def live_blocks(seg_q_IxBxQ, br_q_IxBxQ, seg_k_JxBxC, br_k_JxBxC) -> jax.Array:
    """bool [I, J]: False where query block i and key block j have no allowed pair in any row (conservative)."""
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
    """fn(*arrays, *static) opaque to partial evaluation, so no block mask is hoisted out of the loops."""
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
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxE: one dtype; query head n reads kv head n // (N / K).
      precision: a `jax.lax.Precision` or None; explicit: the custom backward is traced outside the caller's scope.
      block_q, block_k: block lengths (None: `default_block()`; capped at T).
    Returns:
      [B, T, N, E] in q's dtype; a query with no allowed key gets 0 (and zero gradient).
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

    mask `RowIds`: the self-attention of `impl` (`attention_kernels.resolve_impl`; kernels ignore `precision`; extra
    sources raise ValueError); bool [B, T, S]: the dense softmax. A lone `CacheHook` source computes it itself."""
    if len(extra_sources) == 1 and isinstance(extra_sources[0], CacheHook):
        return extra_sources[0].fn(q_BxTxNxH, kv, scale)
    if isinstance(mask, RowIds):
        if extra_sources:
            raise ValueError(f"blockwise attention takes one source; got {len(extra_sources)} extra sources "
                             "(pass a [B, T, S] mask for prefill/decode with cached sources)")
        k, v = kv["k"], kv["v"]
        platform = attention_kernels.mesh_platform()
        impl = attention_kernels.resolve_impl(impl, platform, q_BxTxNxH.shape[-1], v.shape[-1])
        if impl in ("splash", "pallas_gpu"):
            return attention_kernels.fused(impl, q_BxTxNxH, k, v, mask.segment_BxT, mask.branch_BxT, scale, platform)
        if impl == "dense":
            mask = self_mask(mask.segment_BxT, mask.branch_BxT, blockwise=False)
        else:
            return blockwise_attention(q_BxTxNxH, k, v, mask, scale, precision=precision)
    return multi_source_attention(q_BxTxNxH, [*extra_sources, Source(kv, mask)], scale, gqa_logits, gqa_combine)


def self_mask(segment_ids_BxT: jax.Array, branch_ids_BxT: jax.Array, blockwise: bool | None = None):
    """The layers' self-attention mask: `RowIds` when blockwise (None: T >= BLOCKWISE_MIN_LEN), else bool [B, T, T]."""
    T = segment_ids_BxT.shape[1]
    if blockwise if blockwise is not None else T >= BLOCKWISE_MIN_LEN:
        return RowIds(segment_ids_BxT, branch_ids_BxT)
    idx = jnp.arange(T)
    return block_mask(segment_ids_BxT, branch_ids_BxT, idx, segment_ids_BxT, branch_ids_BxT, idx)
