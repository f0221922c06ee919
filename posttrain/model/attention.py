"""Attention core shared by GQA and MLA: multi-source softmax attention and the KV-cache layout.

Design: docs/attention.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

NEG_INF = -1e9  # large but finite: logits + NEG_INF never overflows, fully masked rows stay finite


class Source(NamedTuple):
    """Keys/values to attend: entries {name: [Bs, ...]}, mask bool [Bs, Ts or 1, S], `group` query rows per entry."""

    entries: Any
    mask: jax.Array
    group: int = 1


class CacheHook(NamedTuple):
    """A cache the caller attends to itself (e.g. `posttrain.generate.paged_attention`), as a layer's only source.

    `fn(q [B, T, N, H], own_entries, scale) -> [B, T, N, Hv]` replaces the softmax (MLA: first R dims used)."""

    fn: Any


def multi_source_attention(q, sources: Sequence[Source], scale: float, logits_fn, combine_fn):
    """Softmax attention over the concatenation of several sources.

    Args:
      q: [B, T, N, ...] queries. logits_fn(q_grouped, entries) -> [Bs, g*T, N, S];
      combine_fn(probs [Bs, g*T, N, S], entries) -> [Bs, g*T, N, Hv].
      scale: multiplier on the logits (1/sqrt(d) with optional YaRN mscale^2).
    Returns:
      [B, T, N, Hv] in q's dtype. Softmax is float32; fully masked rows give a uniform (finite) average.
    """
    B, T = q.shape[:2]
    logits, sizes = [], []
    for src in sources:
        bs = B // src.group
        qg = q.reshape(bs, src.group * T, *q.shape[2:])
        lg = logits_fn(qg, src.entries).astype(jnp.float32) * scale
        # an additive bias (not a `where`): its backward needs no residual of the logits' shape
        lg = lg + jnp.where(src.mask, 0.0, NEG_INF)[:, :, None, :]
        sizes.append(lg.shape[-1])
        logits.append(lg.reshape(B, T, lg.shape[2], lg.shape[3]))
    probs = jax.nn.softmax(jnp.concatenate(logits, axis=-1), axis=-1)
    out, start = 0.0, 0
    for src, size in zip(sources, sizes):
        p = probs[..., start:start + size]
        start += size
        bs = B // src.group
        o = combine_fn(p.reshape(bs, src.group * T, *p.shape[2:]).astype(q.dtype), src.entries)
        out = out + o.reshape(B, T, *o.shape[2:]).astype(jnp.float32)
    return out.astype(q.dtype)


# GQA cache layout: keys [B, K, H, S], values [B, K, S, H], the operand layouts of the two attention dots, so decoding
# reads the cache without a transpose (docs/attention.md). Other entries (MLA's "kv") keep [B, S, ...].
CACHE_SEQ_AXIS = {"k_bkhs": -1, "v_bksh": -2}


def to_cache_layout(entries: dict) -> dict:
    """Entries with [..., S, K, H] "k"/"v" in the cache layout ("k_bkhs", "v_bksh"); others (and [L, ...]) as is."""
    out = dict(entries)
    if "k" in out:
        out["k_bkhs"] = jnp.moveaxis(out.pop("k"), -3, -1)
        out["v_bksh"] = jnp.swapaxes(out.pop("v"), -3, -2)
    return out


def cache_seq_axis(name: str) -> int:
    """The sequence axis (negative index) of cache entry `name`."""
    return CACHE_SEQ_AXIS.get(name, -2)


def cache_len(entries: dict) -> int:
    """Number of positions S in cache entries {name: array} (one stack's [L, B, ...] or one layer's [B, ...])."""
    name, e = next(iter(entries.items()))
    return e.shape[cache_seq_axis(name)]


def _per_kv_head_matmul(x_BxTxNxA: jax.Array, y_BxKxAxC: jax.Array) -> jax.Array:
    """float32 [B, T, N, C]: each query head's rows of x times its KV head's [A, C] matrix, without copying y."""
    B, T, N, A = x_BxTxNxA.shape
    K, C = y_BxKxAxC.shape[1], y_BxKxAxC.shape[3]
    x = jnp.swapaxes(x_BxTxNxA.reshape(B, T, K, N // K * A), 1, 2).reshape(B, K, T * (N // K), A)
    out = jnp.einsum("bkqa,bkac->bkqc", x, y_BxKxAxC, preferred_element_type=jnp.float32)
    return jnp.swapaxes(out.reshape(B, K, T, N // K * C), 1, 2).reshape(B, T, N, C)


def gqa_logits(q_BxTxNxH, kv):
    """Unscaled GQA logits float32 [B, T, N, S] against `kv["k"]` [B, S, K, H] or `kv["k_bkhs"]` [B, K, H, S]."""
    B, T, N, H = q_BxTxNxH.shape
    if "k_bkhs" in kv:  # cache layout
        return _per_kv_head_matmul(q_BxTxNxH, kv["k_bkhs"])
    k = kv["k"]
    K = k.shape[2]
    lg = jnp.einsum("btkgh,bskh->btkgs", q_BxTxNxH.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32)
    return lg.reshape(B, T, N, k.shape[1])


def gqa_combine(p_BxTxNxS, kv):
    """Attention-weighted values float32 [B, T, N, H] from `kv["v"]` [B, S, K, H] or `kv["v_bksh"]` [B, K, S, H]."""
    B, T, N, S = p_BxTxNxS.shape
    if "v_bksh" in kv:  # cache layout
        return _per_kv_head_matmul(p_BxTxNxS, kv["v_bksh"])
    v = kv["v"]
    K = v.shape[2]
    o = jnp.einsum("btkgs,bskh->btkgh", p_BxTxNxS.reshape(B, T, K, N // K, S), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, v.shape[-1])


def write_position(cache_e: jax.Array, new_e: jax.Array, name: str, t: jax.Array) -> jax.Array:
    """cache_e with the one-position entries new_e (same layout) written at position t."""
    start = [0] * cache_e.ndim
    start[cache_seq_axis(name) % cache_e.ndim] = t
    return jax.lax.dynamic_update_slice(cache_e, new_e.astype(cache_e.dtype), start)


class DecodeCache(NamedTuple):
    """KV cache of a group-sampling run (a pytree; entries in the cache layout).

    prefix {stack: [L, P, ...]}: per prompt, prefix_len_P valid; suffix {stack: [L, N, ...]}: per sample, `step` set."""

    prefix: Any
    prefix_len_P: jax.Array
    suffix: Any
    step: jax.Array
    shared: Any = None  # {stack: entries [L, 1, ...]} over the C tokens common to every prompt, or None

    def take_rows(self, slots_M: jax.Array) -> "DecodeCache":
        """The cache of M of its N sample rows (int32 [M]), with one prompt part per row (P = N = M, G = 1)."""
        N = jax.tree.leaves(self.suffix)[0].shape[1]
        prompt_M = slots_M // (N // self.prefix_len_P.shape[0])
        rows = lambda idx: (lambda e: jnp.take(e, idx, axis=1))
        return self._replace(prefix=jax.tree.map(rows(prompt_M), self.prefix), prefix_len_P=self.prefix_len_P[prompt_M],
                             suffix=jax.tree.map(rows(slots_M), self.suffix))
