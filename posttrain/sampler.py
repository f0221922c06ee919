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


def categorical(key, logits_NxV: jax.Array, block: int = 256) -> jax.Array:
    """Draws one token per row from softmax(logits_NxV) by blocked inverse-CDF sampling.

    Same law as `jax.random.categorical` (Gumbel-max), but one uniform per row instead of V: on a CPU the V
    random bits per row cost ~15x more than the softmax (64 x 49,152: 67 ms vs 4.6 ms). The vocabulary is cut
    into blocks of `block` tokens; a uniform u in [0, total mass) picks the block by the cumulative block sums,
    then the token inside it by that block's cumulative sums (two short cumsums keep float32 error small).
    Tokens with probability 0 (masked to -inf by top-k/top-p) are never returned: both picks are clamped to the
    last block/token with non-zero mass. Returns int32 [N]. Source: inverse transform sampling.
    """
    N, V = logits_NxV.shape
    nb = -(-V // block)
    x = jnp.pad(logits_NxV.astype(jnp.float32), ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf)
    p = jax.nn.softmax(x, axis=-1).reshape(N, nb, block)

    def pick(mass_NxM, u_N):
        """(first index whose cumulative mass exceeds u, clamped to the last index with mass > 0; cumsum)."""
        cdf = jnp.cumsum(mass_NxM, axis=-1)
        last = mass_NxM.shape[-1] - 1 - jnp.argmax(mass_NxM[:, ::-1] > 0, axis=-1)
        return jnp.minimum((cdf <= u_N[:, None]).sum(-1), last).astype(jnp.int32), cdf

    block_mass = p.sum(-1)
    u = jax.random.uniform(key, (N,), jnp.float32) * block_mass.sum(-1)
    b, cdf_blocks = pick(block_mass, u)
    below = jnp.take_along_axis(cdf_blocks - block_mass, b[:, None], axis=1)[:, 0]
    inner, _ = pick(jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0], u - below)
    return b * block + inner


def _pick(logits_NxV, key, t, params: SamplingParams):
    """(token_N, logp_N) for one step; see the module doc for the logprob definition."""
    T = params.temperature if params.temperature > 0 else 1.0
    scaled = logits_NxV.astype(jnp.float32) / T
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    if params.temperature == 0:
        tok = jnp.argmax(logits_NxV, axis=-1)
    else:
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tok = categorical(jax.random.fold_in(key, t), filtered)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "params", "stop_ids", "pad_id",
                                             "shared_prefix_len"))
def sample(graphdef, state, prompts_PxLp, lengths_P, key, *, group_size: int, params: SamplingParams,
           stop_ids: tuple[int, ...], pad_id: int, shared_prefix_len: int = 0) -> SampleOutput:
    """Samples `group_size` continuations of each right-padded prompt.

    Args:
      graphdef, state: the model (`nnx.split` of a `Transformer`); state may be sharded, and may be a tuple
        of states (e.g. (params, rest) from `nnx.split(model, nnx.Param, ...)`).
      prompts_PxLp: int32 right-padded prompt tokens; lengths_P: int32 valid lengths (>= 1).
      key: PRNG key (fresh per call: the caller splits it from the run's key by step).
      shared_prefix_len: C > 0 when every prompt starts with the same C tokens (e.g. the chat template's system
        turn) and is longer than C: the prefill runs those tokens once for the whole batch instead of P times.
        Use `shared_prefix_len(prompts, lengths)`; outputs are the same up to float rounding.
    Returns:
      SampleOutput with N = P * group_size rows; row p*G + g is sample g of prompt p.
    """
    model = nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))
    Lg = params.max_new_tokens
    logits0, cache = model.prefill(prompts_PxLp, lengths_P, group=group_size, max_new=Lg,
                                  shared_len=shared_prefix_len)
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


def shared_prefix_len(prompts_PxLp: np.ndarray, lengths_P: np.ndarray, multiple: int = 8) -> int:
    """Length C of the token prefix common to all prompts, kept below every prompt's length (each prompt keeps
    at least one token of its own) and rounded down to a multiple of `multiple` (fewer distinct compiled
    shapes). 0 when there is a single prompt or no common prefix. Host-side numpy."""
    prompts_PxLp, lengths_P = np.asarray(prompts_PxLp), np.asarray(lengths_P)
    if prompts_PxLp.shape[0] < 2:
        return 0
    same = (prompts_PxLp == prompts_PxLp[:1]).all(0)
    c = int(same.argmin()) if not same.all() else prompts_PxLp.shape[1]
    c = min(c, int(lengths_P.min()) - 1)
    return max(c // multiple * multiple, 0)
