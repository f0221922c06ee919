"""Token logprobs and entropies: the one definition of a token's logprob (DESIGN invariant 1).

Dimension legend:
  B  sequences in the (micro)batch
  T  token positions (padded sequence width)
  V  vocabulary size
  D  model width (hidden size)
  N  flattened tokens B * T;  K chunks of C tokens each (K * C >= N)

A token's logprob is `log_softmax(logits / temperature)[target]` over the full vocabulary, in float32.
`token_logprobs` is that definition on given logits; `chunked_token_logprobs` computes the same numbers from
hidden states and the unembedding matrix C tokens at a time, never materialising [B, T, V] logits, with a
hand-written backward pass (flash-attention style: logits are recomputed chunk by chunk) that accumulates the
unembedding's gradient in ONE [D, V] float32 buffer. Autodiff of a chunk loop that skips empty chunks with
`lax.cond` would instead stack one [D, V] weight cotangent per chunk (37 GiB for Qwen3-0.6B at 16 x 2176 tokens).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posttrain.precision import lax_precision


def check_temperature(temperature) -> None:
    """Raises ValueError when a Python-number temperature is not > 0 (traced values are not checked)."""
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def token_logprobs(logits_BxTxV, targets_BxT, temperature: float = 1.0):
    """log_softmax(logits / temperature) gathered at the targets. float32 [B, T] (nats, <= 0).

    Raises ValueError if targets_BxT's shape is not logits_BxTxV.shape[:2] or temperature <= 0.
    """
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
    """`token_logprobs(h @ w, targets, temperature)` (and optionally `token_entropy`) C tokens at a time.

    Neither pass holds more than [C, V] logits; the backward pass recomputes each chunk's logits and adds its
    weight gradient into one float32 [D, V] accumulator.

    Args:
      h_BxTxD: final hidden states (after the final norm), any float dtype (the compute dtype).
      w_DxV: unembedding matrix (the transposed tied embedding for tied models); cast to h's dtype for the matmul.
      targets_BxT: int token ids whose logprob is wanted (the next tokens).
      temperature: sampling temperature (> 0, a Python float); logits are divided by it.
      chunk_size: C, tokens per chunk (static); the last chunk is zero-padded.
      with_entropy: also return the per-token entropy.
      valid_BxT: optional bool mask; a chunk with no valid token is skipped in both passes (`lax.cond`) and returns
        zeros. Put valid tokens first (see `valid_first_order`) to skip all padding chunks.
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
    n = b * t
    c = min(chunk_size, n)
    k = -(-n // c)
    h_KxCxD = jnp.pad(jnp.reshape(h_BxTxD, (n, d)), ((0, k * c - n), (0, 0))).reshape(k, c, d)
    tgt_KxC = jnp.pad(jnp.reshape(targets_BxT, (n,)).astype(jnp.int32), (0, k * c - n)).reshape(k, c)
    valid = jnp.ones((b, t), bool) if valid_BxT is None else jnp.asarray(valid_BxT, bool)
    any_K = jnp.pad(jnp.reshape(valid, (n,)), (0, k * c - n)).reshape(k, c).any(-1)
    inv_t = jnp.asarray(1.0 / temperature, jnp.float32)
    logp_KxC, ent_KxC = _chunked(h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t, with_entropy, prec)
    unchunk = lambda x_KxC: x_KxC.reshape(k * c)[:n].reshape(b, t)
    return LogprobsOut(unchunk(logp_KxC), unchunk(ent_KxC) if with_entropy else None)


def _chunk_logits(h_CxD, w_DxV, inv_t, prec):
    """float32 [C, V] logits / T of one chunk (operands in h's dtype, float32 accumulation)."""
    return jnp.dot(h_CxD, w_DxV.astype(h_CxD.dtype), precision=prec, preferred_element_type=jnp.float32) * inv_t


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked(h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t, with_entropy, prec):
    return _chunked_fwd(h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t, with_entropy, prec)[0]


def _chunked_fwd(h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t, with_entropy, prec):
    def compute(h_CxD, tgt_C):
        z_CxV = _chunk_logits(h_CxD, w_DxV, inv_t, prec)
        logp_C, ent_C = logp_and_entropy(z_CxV, tgt_C, with_entropy)
        return logp_C, ent_C if with_entropy else jnp.zeros_like(logp_C)

    def skip(h_CxD, tgt_C):
        zeros = jnp.zeros(tgt_C.shape, jnp.float32)
        return zeros, zeros

    def body(_, xs):
        h_CxD, tgt_C, any_valid = xs
        return None, jax.lax.cond(any_valid, compute, skip, h_CxD, tgt_C)

    _, out = jax.lax.scan(body, None, (h_KxCxD, tgt_KxC, any_K))
    return out, (h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t)


def _chunked_bwd(with_entropy, prec, res, g):
    """d/dz of logp_t = onehot_t - p; of H = -sum p log p: -p (log p + H); z = h w / T."""
    h_KxCxD, w_DxV, tgt_KxC, any_K, inv_t = res
    g_logp_KxC, g_ent_KxC = g
    cdt = h_KxCxD.dtype

    def compute(dw_DxV, h_CxD, tgt_C, g_logp_C, g_ent_C):
        z_CxV = _chunk_logits(h_CxD, w_DxV, inv_t, prec)
        logp_CxV = jax.nn.log_softmax(z_CxV, axis=-1)
        p_CxV = jnp.exp(logp_CxV)
        onehot_CxV = jax.nn.one_hot(tgt_C, z_CxV.shape[-1], dtype=jnp.float32)
        dz_CxV = g_logp_C[:, None] * (onehot_CxV - p_CxV)
        if with_entropy:
            ent_C = -jnp.sum(p_CxV * logp_CxV, axis=-1)
            dz_CxV = dz_CxV - g_ent_C[:, None] * p_CxV * (logp_CxV + ent_C[:, None])
        dz_CxV = (dz_CxV * inv_t).astype(cdt)
        dh_CxD = jnp.dot(dz_CxV, w_DxV.astype(cdt).T, precision=prec, preferred_element_type=jnp.float32)
        dw_DxV = dw_DxV + jnp.dot(h_CxD.T, dz_CxV, precision=prec, preferred_element_type=jnp.float32)
        return dw_DxV, dh_CxD.astype(cdt)

    def skip(dw_DxV, h_CxD, tgt_C, g_logp_C, g_ent_C):
        return dw_DxV, jnp.zeros_like(h_CxD)

    def body(dw_DxV, xs):
        h_CxD, tgt_C, any_valid, g_logp_C, g_ent_C = xs
        return jax.lax.cond(any_valid, compute, skip, dw_DxV, h_CxD, tgt_C, g_logp_C, g_ent_C)

    dw0 = jnp.zeros(w_DxV.shape, jnp.float32)
    dw_DxV, dh_KxCxD = jax.lax.scan(body, dw0, (h_KxCxD, tgt_KxC, any_K, g_logp_KxC, g_ent_KxC))
    return dh_KxCxD, dw_DxV.astype(w_DxV.dtype), None, None, jnp.zeros_like(inv_t)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def valid_first_order(valid_N) -> tuple[jax.Array, jax.Array]:
    """(order, inverse) permutations of a flat bool mask putting valid entries first (stable), so that chunked
    computations over `x[order]` can skip every chunk past the valid count; `y[inverse]` restores the layout."""
    order = jnp.argsort(~jnp.asarray(valid_N, bool), stable=True)
    return order, jnp.argsort(order)
