"""Jitted KV-cache sampler: one prefill per prompt, G samples per prompt, `lax.while_loop` decoding.

Dimension legend: P prompts, G samples per prompt (group size), N = P*G sequences, Lp padded prompt width,
Lg max new tokens, V vocab.

Logprob definition (the project's single one, DESIGN.md invariant 1): for every generated token,
`logp = log_softmax(logits / T)[token]` over the full vocabulary, with T the sampling temperature (T := 1 for
greedy decoding). Top-k / top-p only restrict which token is *drawn*; the recorded logprob is always over the
full vocabulary, so a teacher-forced pass at the same T reproduces it and the GRPO ratio starts at exactly 1.
Stopping is per sequence: after a stop token (EOS or end-of-turn), positions hold `pad_id` and logprob 0;
`lengths_N` counts generated tokens including the stop token; `truncated_N` marks sequences that hit Lg.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling params: temperature={self.temperature} (>= 0), "
                             f"top_p={self.top_p} (in (0, 1]), top_k={self.top_k} (>= 0)")


class SampleOutput(NamedTuple):
    tokens_NxLg: jax.Array      # int32, pad_id after the stop token
    logp_NxLg: jax.Array        # float32, log_softmax(logits / T) at each token; 0 after the stop token
    lengths_N: jax.Array        # int32, generated tokens including the stop token
    truncated_N: jax.Array      # bool, no stop token within Lg


def filter_logits(scaled_NxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Masks (to -inf) tokens outside the top-k and outside the smallest set with probability >= top_p."""
    x = scaled_NxV
    if top_k and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p < 1.0:
        desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        keep = jnp.maximum((before < top_p).sum(-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(desc, keep - 1, axis=-1)
        x = jnp.where(x < threshold, -jnp.inf, x)
    return x


def _pick(logits_NxV, key, t, params: SamplingParams):
    """(token_N, logp_N) for one step; see the module doc for the logprob definition."""
    T = params.temperature if params.temperature > 0 else 1.0
    scaled = logits_NxV.astype(jnp.float32) / T
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    if params.temperature == 0:
        tok = jnp.argmax(logits_NxV, axis=-1)
    else:
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tok = jax.random.categorical(jax.random.fold_in(key, t), filtered, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "params", "stop_ids", "pad_id"))
def sample(graphdef, state, prompts_PxLp, lengths_P, key, *, group_size: int, params: SamplingParams,
           stop_ids: tuple[int, ...], pad_id: int) -> SampleOutput:
    """Samples `group_size` continuations of each right-padded prompt.

    Args:
      graphdef, state: the model (`nnx.split` of a `Transformer`); state may be sharded, and may be a tuple
        of states (e.g. (params, rest) from `nnx.split(model, nnx.Param, ...)`).
      prompts_PxLp: int32 right-padded prompt tokens; lengths_P: int32 valid lengths (>= 1).
      key: PRNG key (fresh per call: the caller splits it from the run's key by step).
    Returns:
      SampleOutput with N = P * group_size rows; row p*G + g is sample g of prompt p.
    """
    model = nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))
    Lg = params.max_new_tokens
    logits0, cache = model.prefill(prompts_PxLp, lengths_P, group=group_size, max_new=Lg)
    logits0 = jnp.repeat(logits0, group_size, axis=0)
    N = logits0.shape[0]
    stops = jnp.asarray(stop_ids, jnp.int32)
    tok, lp = _pick(logits0, key, 0, params)
    tokens = jnp.full((N, Lg), pad_id, jnp.int32).at[:, 0].set(tok)
    logp = jnp.zeros((N, Lg), jnp.float32).at[:, 0].set(lp)
    done = jnp.isin(tok, stops)
    lengths = jnp.ones((N,), jnp.int32)

    def cond(carry):
        t, _, _, done, _, _, _ = carry
        return (t < Lg) & ~jnp.all(done)

    def body(carry):
        t, tokens, logp, done, lengths, cache, prev = carry
        logits, cache = model.decode_step(prev, cache)
        tok, lp = _pick(logits, key, t, params)
        tok = jnp.where(done, pad_id, tok)
        lp = jnp.where(done, 0.0, lp)
        tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, t))
        logp = jax.lax.dynamic_update_slice(logp, lp[:, None], (0, t))
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, stops)
        return t + 1, tokens, logp, done, lengths, cache, tok

    carry = (jnp.ones((), jnp.int32), tokens, logp, done, lengths, cache, tok)
    _, tokens, logp, done, lengths, _, _ = jax.lax.while_loop(cond, body, carry)
    return SampleOutput(tokens, logp, lengths, ~done)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists to a width rounded up to `bucket` (fewer distinct shapes, fewer compiles).

    Returns (tokens_PxLp int32, lengths_P int32). Raises ValueError on an empty prompt.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    width = -(-width // bucket) * bucket
    out = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)
