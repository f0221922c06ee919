"""The rollout engine's sampling rule: per-row settings, stop rows, the uniforms and the draw (docs/engine.md).

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.generate.sampler import categorical, logprob_temperature


def filter_logits_rows(scaled_SxV, top_k_S, top_p_S):
    """`sampler.filter_logits` with each row's own top-k (0: off) and top-p (1: off): tokens outside them -> -inf."""
    V = scaled_SxV.shape[-1]
    desc = -jnp.sort(-scaled_SxV, axis=-1)
    k = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    x = jnp.where(scaled_SxV < kth, -jnp.inf, scaled_SxV)
    desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = jnp.maximum((before < top_p_S[:, None]).sum(-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(desc, keep - 1, axis=-1)
    return jnp.where((top_p_S[:, None] < 1.0) & (x < threshold), -jnp.inf, x)


def request_rows(requests: Sequence) -> dict:
    """`pick_tokens`' per-row arrays {"T", "greedy", "top_k", "top_p", "live"} [S] of one request (or None) per slot."""
    def col(fn, dtype):
        return jnp.asarray(np.asarray([fn(r) for r in requests], dtype))

    return {"T": col(lambda r: logprob_temperature(r.temperature) if r else 1.0, np.float32),
            "greedy": col(lambda r: r.temperature == 0 if r else True, bool),
            "top_k": col(lambda r: r.top_k if r else 0, np.int32),
            "top_p": col(lambda r: r.top_p if r else 1.0, np.float32),
            "live": col(lambda r: r is not None, bool)}


def stop_rows(stop_ids: Sequence[tuple[int, ...]]) -> np.ndarray:
    """Each slot's stop ids as int32 [S, X] padded with -1; X a power of two (1 when no slot has any)."""
    width = 1 << (max(map(len, stop_ids)) - 1).bit_length() if any(stop_ids) else 1
    out = np.full((len(stop_ids), width), -1, np.int32)
    for s, ids in enumerate(stop_ids):
        out[s, :len(ids)] = ids
    return out


@functools.partial(jax.jit, static_argnames=("steps", "width"))
def token_uniforms(key, request_S, t_S, *, steps: int, width: int):
    """float32 [steps, S]: the uniforms of each slot's next `steps` tokens, the dense sampler's (docs/engine.md).

    Request r's token t takes element r of `jax.random.uniform(jax.random.fold_in(key, t), (width,))`; `width`
    (> every request index: `uniform_width`) sets only the compile under `jax_threefry_partitionable`."""
    def one(r, t):
        return jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, t + j), (width,), jnp.float32)[r])(
            jnp.arange(steps))
    return jax.vmap(one)(request_S, t_S).T


def uniform_width(max_request: int) -> int:
    """`token_uniforms`' width for request indices up to max_request: a power of two, at least 64."""
    return max(64, 1 << int(max_request).bit_length())


def pick_tokens(logits_SxV, rows: dict, u_S):
    """(token int32 [S], logprob float32 [S] over the whole vocabulary at T): argmax where greedy, else a u_S draw."""
    scaled = logits_SxV.astype(jnp.float32) / rows["T"][:, None]
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    live = rows["live"]
    greedy = jax.lax.cond((rows["greedy"] & live).any(), lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
                          lambda x: jnp.zeros(x.shape[:1], jnp.int32), logits_SxV)  # only when a live row is greedy
    top_k, top_p = rows["top_k"], rows["top_p"]

    def draw(x):  # the sorts of top-k / top-p (two [S, V] sorts) only when some row asks for them
        x = jax.lax.cond((((top_k > 0) | (top_p < 1.0)) & live).any(), lambda x: filter_logits_rows(x, top_k, top_p),
                         lambda x: x, x)
        return categorical(u_S, x).astype(jnp.int32)

    drawn = jax.lax.cond((rows["greedy"] | ~live).all(), lambda x: greedy, draw, scaled)  # no draw at all
    tok = jnp.where(rows["greedy"], greedy, drawn)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
