"""Jitted KV-cache sampler: one prefill per prompt, G samples per prompt, `lax.while_loop` decoding (docs/engine.md).

Logprobs: `log_softmax(logits / T)` over the full vocabulary (design.md invariant 1); top-k / top-p only restrict
the draw. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.generate import streaming


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampling distribution and length of one `sample` call (hashable); ValueError outside the ranges below.

    Attributes:
        max_new_tokens: Lg, generated tokens per sequence (>= 1).
        temperature: logits are divided by it (>= 0; 0: greedy).
        top_p: nucleus mass kept (in (0, 1]; 1.0: off).
        top_k: keep the k most likely tokens (>= 0; 0: off)."""

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
    # routing replay (`sample(record_routing=True)` on a MoE model; else None): the experts each MoE layer
    # selected for every prompt token and every generated token that was fed back (the last one never is: -1)
    prompt_experts_PxLpxLxk: jax.Array | None = None  # int32 [P, Lp, L, k] (L MoE layers)
    experts_NxLgxLxk: jax.Array | None = None         # int32 [N, Lg, L, k]; -1 where not computed
    versions_NxLg: jax.Array | None = None  # int32 policy version of each token (-1 past the end); engine only


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


def categorical(u_N: jax.Array, logits_NxV: jax.Array, block: int = 256) -> jax.Array:
    """int32 [N] tokens drawn from softmax(logits_NxV) by blocked inverse-CDF sampling, one uniform u_N per row.

    Same law as `jax.random.categorical` with one random number per row; zero-probability tokens are never drawn."""
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
    u = u_N.astype(jnp.float32) * block_mass.sum(-1)
    b, cdf_blocks = pick(block_mass, u)
    below = jnp.take_along_axis(cdf_blocks - block_mass, b[:, None], axis=1)[:, 0]
    inner, _ = pick(jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0], u - below)
    return b * block + inner


def logprob_temperature(temperature: float) -> float:
    """The T of every recorded and trained logprob `log_softmax(logits / T)`: the temperature, or 1 for greedy."""
    return temperature if temperature > 0 else 1.0


def _pick(logits_MxV, key, t, params: SamplingParams, rows_M, num_rows: int):
    T = logprob_temperature(params.temperature)
    scaled = logits_MxV.astype(jnp.float32) / T
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    if params.temperature == 0:
        tok = jnp.argmax(logits_MxV, axis=-1)
    else:
        u = jax.random.uniform(jax.random.fold_in(key, t), (num_rows,), jnp.float32)
        tok = categorical(u[rows_M], filter_logits(scaled, params.top_k, params.top_p))
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "params", "stop_ids", "pad_id",
                                             "shared_prefix_len", "shrink", "record_routing", "stream_every"))
def sample(graphdef, state, prompts_PxLp, lengths_P, key, *, group_size: int, params: SamplingParams,
           stop_ids: tuple[int, ...], pad_id: int, shared_prefix_len: int = 0,
           shrink: tuple[int, ...] = (), record_routing: bool = False, stream_every: int = 0,
           stream_id=None) -> SampleOutput:
    """Samples `group_size` continuations of each right-padded prompt.

    Args:
      graphdef, state: the model (`nnx.split` of a `Transformer`); state may be sharded, and may be a tuple
        of states (e.g. (params, rest) from `nnx.split(model, nnx.Param, ...)`).
      prompts_PxLp: int32 right-padded prompt tokens; lengths_P: int32 valid lengths (>= 1).
      key: PRNG key (fresh per call: the caller splits it from the run's key by step).
      shared_prefix_len: C > 0 when every prompt starts with the same C tokens (e.g. the chat template's system
        turn) and is longer than C: the prefill runs those tokens once for the whole batch instead of P times.
        Use `shared_prefix_len(prompts, lengths)`; outputs are the same up to float rounding.
      shrink: decreasing decode batch widths (e.g. `shrink_schedule(N)`): once no more than w rows are
        unfinished, the decode loop drops the finished rows and continues on w rows (their cache is gathered
        once, see `DecodeCache.take_rows`), so long-tail completions stop paying for the finished ones. Widths
        >= N are ignored. Outputs are the same up to float rounding (each row keeps its own random draws; a
        narrower batch can round the logits differently); each width compiles its own decode loop. On a sharded
        batch, use widths divisible by the batch shards.
      record_routing: also return the MoE layers' expert selections (routing replay; see `SampleOutput`).
      stream_every, stream_id: with stream_every = K > 0, every K decode steps the rows finished so far are handed
        to the host (`rollout.streaming.deliver`, by a host callback, to the sink registered under the int32
        scalar stream_id): streaming scoring. Outputs are unchanged (a finished row's tokens never change again).
    Returns:
      SampleOutput with N = P * group_size rows; row p*G + g is sample g of prompt p.
    Raises:
      ValueError: `shrink` not strictly decreasing positive ints.
    """
    if any(w < 1 for w in shrink) or any(a <= b for a, b in zip(shrink, shrink[1:])):
        raise ValueError(f"shrink must be strictly decreasing positive batch widths, got {shrink}")
    model = nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))
    Lg = params.max_new_tokens
    logits0, cache, prompt_routing = model.prefill(prompts_PxLp, lengths_P, group=group_size, max_new=Lg,
                                                   shared_len=shared_prefix_len, return_routing=True)
    record_routing = record_routing and prompt_routing is not None
    logits0 = jnp.repeat(logits0, group_size, axis=0)
    N = logits0.shape[0]
    stops = jnp.asarray(stop_ids, jnp.int32)
    rows = jnp.arange(N, dtype=jnp.int32)  # slot -> sample row; slots are reordered and dropped by `shrink`
    tok, lp = _pick(logits0, key, 0, params, rows, N)
    tokens = jnp.full((N, Lg), pad_id, jnp.int32).at[:, 0].set(tok)
    logp = jnp.zeros((N, Lg), jnp.float32).at[:, 0].set(lp)
    done = jnp.isin(tok, stops)  # per slot
    lengths = jnp.ones((N,), jnp.int32)
    experts = None  # [N, Lg, L, k]: the experts of generated token t - 1, written when it is fed at step t
    if record_routing:
        L, k = prompt_routing.shape[0], prompt_routing.shape[-1]
        experts = jnp.full((N, Lg, L, k), -1, jnp.int32)

    def body(carry):
        t, tokens, logp, lengths, rows, done, cache, prev, experts = carry
        if stream_every:  # the rows finished so far: dropped by a shrink (all done) or done in their slot
            jax.lax.cond(t % stream_every == 0, lambda: streaming.emit(
                stream_id, jnp.ones((N,), bool).at[rows].set(done), tokens, lengths), lambda: None)
        if record_routing:
            logits, cache, routed_LxMxk = model.decode_step(prev, cache, return_routing=True)
            experts = experts.at[rows, t - 1].set(jnp.where(done[:, None, None], -1, routed_LxMxk.transpose(1, 0, 2)))
        else:
            logits, cache = model.decode_step(prev, cache)
        tok, lp = _pick(logits, key, t, params, rows, N)
        tok = jnp.where(done, pad_id, tok)
        tokens = tokens.at[rows, t].set(tok)
        logp = logp.at[rows, t].set(jnp.where(done, 0.0, lp))
        lengths = lengths.at[rows].add((~done).astype(jnp.int32))
        return t + 1, tokens, logp, lengths, rows, done | jnp.isin(tok, stops), cache, tok, experts

    carry = (jnp.ones((), jnp.int32), tokens, logp, lengths, rows, done, cache, tok, experts)
    for width in tuple(w for w in shrink if w < N) + (0,):
        carry = jax.lax.while_loop(lambda c, w=width: (c[0] < Lg) & ((~c[5]).sum() > w), body, carry)
        if width:  # keep the unfinished slots first (at most `width` of them), drop the rest
            t, tokens, logp, lengths, rows, done, cache, prev, experts = carry
            keep = jnp.argsort(done.astype(jnp.int32), stable=True)[:width].astype(jnp.int32)
            carry = (t, tokens, logp, lengths, rows[keep], done[keep], cache.take_rows(keep), prev[keep], experts)
    _, tokens, logp, lengths, _, _, _, _, experts = carry
    truncated = (lengths == Lg) & ~jnp.isin(tokens[:, -1], stops)  # no stop token within Lg
    if not record_routing:
        return SampleOutput(tokens, logp, lengths, truncated)
    return SampleOutput(tokens, logp, lengths, truncated, prompt_routing.transpose(1, 2, 0, 3), experts)


def shrink_schedule(num_rows: int, multiple: int = 8, steps: int = 2, factor: float = 0.75) -> tuple[int, ...]:
    """Up to `steps` widths for `sample(shrink=)`, each `factor` of the last, rounded down to `multiple` (64: 48,32)."""
    out, width = [], num_rows
    for _ in range(steps):
        nxt = int(width * factor) // multiple * multiple
        if nxt < multiple or nxt >= width:
            break
        out.append(nxt)
        width = nxt
    return tuple(out)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_PxLp, lengths_P) int32: prompts right-padded to a multiple of `bucket`; ValueError if any is empty."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    width = -(-width // bucket) * bucket
    out = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def shared_prefix_len(prompts_PxLp: np.ndarray, lengths_P: np.ndarray, multiple: int = 8, template: int = 0) -> int:
    """Length C of the prefix all prompts share, below every prompt's length, rounded down to `multiple` (0: none).

    `template` (`template_prefix_len`): when the batch shares that many tokens, C is that length (no new compile)."""
    prompts_PxLp, lengths_P = np.asarray(prompts_PxLp), np.asarray(lengths_P)
    if prompts_PxLp.shape[0] < 2:
        return 0
    same = (prompts_PxLp == prompts_PxLp[:1]).all(0)
    c = int(same.argmin()) if not same.all() else prompts_PxLp.shape[1]
    c = min(c, int(lengths_P.min()) - 1)
    if 0 < template <= c:
        c = template
    return max(c // multiple * multiple, 0)


def template_prefix_len(render: Callable[[str], Sequence[int]]) -> int:
    """Length of the token prefix `render` (user message -> prompt token ids) gives every message."""
    a, b = list(render("0")), list(render("Zq"))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
