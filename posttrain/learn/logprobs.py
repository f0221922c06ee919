"""Token logprobs and entropies: the one definition of a token's logprob (design.md invariant 1; docs/learner.md).

Shapes: the legend in `posttrain.types`; K chunks of C positions."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.infra import mesh as mesh_lib
from posttrain.infra.partitioning import active_mesh, current_rules, with_logical_constraint
from posttrain.infra.precision import lax_precision


def check_temperature(temperature) -> None:
    """Raises ValueError when a Python-number temperature is not > 0 (traced values are not checked)."""
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def token_logprobs(logits_BxTxV, targets_BxT, temperature: float = 1.0):
    """log_softmax(logits / temperature) at the targets: float32 [B, T]; ValueError on bad shapes or temperature."""
    check_temperature(temperature)
    if jnp.shape(targets_BxT) != jnp.shape(logits_BxTxV)[:2]:
        raise ValueError(f"targets_BxT shape {jnp.shape(targets_BxT)} != logits {jnp.shape(logits_BxTxV)}[:2]")
    return logp_and_entropy(jnp.asarray(logits_BxTxV).astype(jnp.float32) / temperature, targets_BxT)[0]


def token_entropy(logits_BxTxV, temperature: float = 1.0):
    """Entropy of softmax(logits / temperature) per position, float32 [B, T] (nats)."""
    check_temperature(temperature)
    return logp_and_entropy(jnp.asarray(logits_BxTxV).astype(jnp.float32) / temperature, None, True)[1]


def logp_and_entropy(z_xV, targets_x, with_entropy: bool = False):
    """(log_softmax(z)[targets] or None, entropy or None) over the last axis of float32 logits z."""
    logp_xV = jax.nn.log_softmax(z_xV, axis=-1)
    logp_x = None
    if targets_x is not None:
        logp_x = jnp.take_along_axis(logp_xV, jnp.asarray(targets_x, jnp.int32)[..., None], axis=-1)[..., 0]
    return logp_x, -jnp.sum(jnp.exp(logp_xV) * logp_xV, axis=-1) if with_entropy else None


class LogprobsOut(NamedTuple):
    logp_BxT: jax.Array  # float32
    entropy_BxT: jax.Array | None  # float32, None unless requested


def chunked_token_logprobs(
    h_BxTxD, w_DxV, targets_BxT, temperature: float = 1.0, *, chunk_size: int = 1024,
    with_entropy: bool = False, valid_BxT=None, precision: str | None = None,
) -> LogprobsOut:
    """`token_logprobs(h @ w, targets, temperature)`, C positions of every row at a time.

    With `with_entropy` it also returns `token_entropy` of the same logits.

    Neither pass holds more than [B, C, V] logits; the backward pass recomputes each chunk's logits and adds its
    weight gradient into one float32 [D, V] accumulator. Chunks run along T, so rows split over devices (B
    sharded) stay where they are: each device computes its own rows' part of every chunk.

    Args:
      h_BxTxD: final hidden states (after the final norm), any float dtype (the compute dtype).
      w_DxV: unembedding matrix (the transposed tied embedding for tied models); cast to h's dtype for the matmul.
      targets_BxT: int token ids whose logprob is wanted (the next tokens).
      temperature: sampling temperature (> 0, a Python float); logits are divided by it.
      chunk_size: C, positions per row per chunk (static); the last chunk is zero-padded.
      with_entropy: also return the per-token entropy.
      valid_BxT: optional bool mask; a chunk with no valid token in any row is skipped in both passes (`lax.cond`)
        and returns zeros. Put each row's valid tokens first (see `valid_first_order`) to skip padding chunks.
      precision: matmul precision "default" | "high" | "highest" (None: the backend's default).
    Returns:
      LogprobsOut(logp_BxT float32, entropy_BxT float32 or None). Matmuls accumulate in float32; gradients come
      back in h's and w's dtypes.
    Raises:
      ValueError: on shape mismatch, chunk_size < 1, temperature <= 0 or an unknown precision.
    """
    check_temperature(temperature)
    (b, t, d), (d_w, v) = jnp.shape(h_BxTxD), jnp.shape(w_DxV)
    if d_w != d or jnp.shape(targets_BxT) != (b, t):
        raise ValueError(f"shape mismatch: h_BxTxD {(b, t, d)}, w_DxV {(d_w, v)}, targets {jnp.shape(targets_BxT)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    prec = lax_precision(precision)
    c = min(chunk_size, t)
    k = -(-t // c)

    def chunks(x_BxT, *tail):  # [B, T, ...] -> [K, B, C, ...], zero-padded along T
        x = jnp.pad(x_BxT, ((0, 0), (0, k * c - t)) + ((0, 0),) * len(tail))
        return jnp.moveaxis(x.reshape((b, k, c) + tail), 1, 0)

    h_KxBxCxD = chunks(h_BxTxD, d)
    tgt_KxBxC = chunks(jnp.asarray(targets_BxT, jnp.int32))
    valid = jnp.ones((b, t), bool) if valid_BxT is None else jnp.asarray(valid_BxT, bool)
    any_K = chunks(valid).any((1, 2))
    inv_t = jnp.asarray(1.0 / temperature, jnp.float32)
    logp_KxBxC, ent_KxBxC = _chunked(h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t, with_entropy, prec)
    unchunk = lambda x_KxBxC: jnp.moveaxis(x_KxBxC, 0, 1).reshape(b, k * c)[:, :t]
    return LogprobsOut(unchunk(logp_KxBxC), unchunk(ent_KxBxC) if with_entropy else None)


def _chunk_logits(h_MxD, w_DxV, inv_t, prec):
    return jnp.dot(h_MxD, w_DxV.astype(h_MxD.dtype), precision=prec, preferred_element_type=jnp.float32) * inv_t


def _flat(x_BxC):
    """[B, C, ...] -> [B * C, ...] (B major: sharding kept); XLA:CPU's rank-3 chunk bodies touch far more memory."""
    return x_BxC.reshape((-1,) + x_BxC.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked(h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t, with_entropy, prec):
    return _chunked_fwd(h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t, with_entropy, prec)[0]


def _chunked_fwd(h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t, with_entropy, prec):
    def compute(h_BxCxD, tgt_BxC):
        z_MxV = _chunk_logits(_flat(h_BxCxD), w_DxV, inv_t, prec)
        logp_M, ent_M = logp_and_entropy(z_MxV, _flat(tgt_BxC), with_entropy)
        return logp_M.reshape(tgt_BxC.shape), (ent_M if with_entropy else jnp.zeros_like(logp_M)).reshape(
            tgt_BxC.shape)

    def skip(h_BxCxD, tgt_BxC):
        zeros = jnp.zeros(tgt_BxC.shape, jnp.float32)
        return zeros, zeros

    def body(_, xs):
        h_BxCxD, tgt_BxC, any_valid = xs
        return None, jax.lax.cond(any_valid, compute, skip, h_BxCxD, tgt_BxC)

    _, out = jax.lax.scan(body, None, (h_KxBxCxD, tgt_KxBxC, any_K))
    return out, (h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t)


def _chunked_bwd(with_entropy, prec, res, g):
    """d/dz of logp_t = onehot_t - p; of H = -sum p log p: -p (log p + H); z = h w / T."""
    h_KxBxCxD, w_DxV, tgt_KxBxC, any_K, inv_t = res
    g_logp_KxBxC, g_ent_KxBxC = g
    cdt = h_KxBxCxD.dtype

    def compute(dw_DxV, h_BxCxD, tgt_BxC, g_logp_BxC, g_ent_BxC):
        h_MxD, g_logp_M, g_ent_M = _flat(h_BxCxD), _flat(g_logp_BxC), _flat(g_ent_BxC)
        z_MxV = _chunk_logits(h_MxD, w_DxV, inv_t, prec)
        logp_MxV = jax.nn.log_softmax(z_MxV, axis=-1)
        p_MxV = jnp.exp(logp_MxV)
        onehot_MxV = jax.nn.one_hot(_flat(tgt_BxC), z_MxV.shape[-1], dtype=jnp.float32)
        dz_MxV = g_logp_M[:, None] * (onehot_MxV - p_MxV)
        if with_entropy:
            ent_M = -jnp.sum(p_MxV * logp_MxV, axis=-1)
            dz_MxV = dz_MxV - g_ent_M[:, None] * p_MxV * (logp_MxV + ent_M[:, None])
        dz_MxV = (dz_MxV * inv_t).astype(cdt)
        dh_MxD = jnp.dot(dz_MxV, w_DxV.astype(cdt).T, precision=prec, preferred_element_type=jnp.float32)
        dw_DxV = dw_DxV + jnp.dot(h_MxD.T, dz_MxV, precision=prec, preferred_element_type=jnp.float32)
        return dw_DxV, dh_MxD.astype(cdt).reshape(h_BxCxD.shape)

    def skip(dw_DxV, h_BxCxD, tgt_BxC, g_logp_BxC, g_ent_BxC):
        return dw_DxV, jnp.zeros_like(h_BxCxD)

    def body(dw_DxV, xs):
        h_BxCxD, tgt_BxC, any_valid, g_logp_BxC, g_ent_BxC = xs
        return jax.lax.cond(any_valid, compute, skip, dw_DxV, h_BxCxD, tgt_BxC, g_logp_BxC, g_ent_BxC)

    dw0 = jnp.zeros(w_DxV.shape, jnp.float32)
    dw_DxV, dh_KxBxCxD = jax.lax.scan(body, dw0, (h_KxBxCxD, tgt_KxBxC, any_K, g_logp_KxBxC, g_ent_KxBxC))
    return dh_KxBxCxD, dw_DxV.astype(w_DxV.dtype), None, None, jnp.zeros_like(inv_t)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def valid_first_order(valid_N) -> tuple[jax.Array, jax.Array]:
    """(order, inverse) permutations putting a flat mask's valid entries first (stable); `y[inverse]` undoes it."""
    order = jnp.argsort(~jnp.asarray(valid_N, bool), stable=True)
    return order, jnp.argsort(order)


# ----------------------------------------------------------------------------- a model's logprobs on a batch
def score_logprobs(model, batch, temperature: float, chunk: int, with_entropy: bool = False,
                   precision: str = "default"):
    """(LogprobsOut of float32 [N, C], 0 on masked slots; aux): only valid slots reach the unembedding."""
    replay = batch.routed_experts_RxLxLmxk  # routing replay: the sampler's expert selections, or None
    h, aux = model.hidden_states(batch.tokens_RxL, batch.positions_RxL, batch.segment_ids_RxL,
                                 batch.branch_ids_RxL,
                                 replay_experts_LxBxTxk=None if replay is None else replay.transpose(2, 0, 1, 3))
    R, L, D = h.shape
    N, C = batch.targets_NxC.shape
    P = _local_shards(R)  # P batch shards, each with R/P rows and their N/P samples
    rows = jnp.repeat(jnp.arange(R // P, dtype=jnp.int32), N // R)
    flat = jnp.tile(rows, P).reshape(P, N // P, 1) * L + batch.score_pos_NxC.reshape(P, N // P, C)
    flat = flat.reshape(P, -1)  # [P, N/P * C] positions within the shard's rows
    valid = (batch.loss_mask_NxC & batch.valid_N[:, None]).reshape(P, -1)
    order, inverse = jax.vmap(valid_first_order)(valid)
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    h_sel = take(h.reshape(P, R // P * L, D), take(flat, order))
    h_sel = with_logical_constraint(h_sel, ("batch", None, None))
    out = chunked_token_logprobs(h_sel, model.unembedding(), take(batch.targets_NxC.reshape(P, -1), order),
                                            temperature, chunk_size=chunk, with_entropy=with_entropy,
                                            valid_BxT=take(valid, order), precision=precision)
    unsort = lambda x: None if x is None else take(x, inverse).reshape(N, C)
    return LogprobsOut(unsort(out.logp_BxT), unsort(out.entropy_BxT)), aux


def _local_shards(rows: int) -> int:
    mesh = active_mesh()
    if mesh is None:
        return 1
    n = mesh_lib.batch_shards(mesh.shape, current_rules())
    return n if rows % n == 0 else 1
