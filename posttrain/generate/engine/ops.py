"""The rollout engine's settings, requests and device programs (`posttrain.generate.engine.loop` runs the host loop).

Compiles, preemption, sampling and logprobs: docs/engine.md.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.model.attention import CacheHook
from posttrain.generate import kv_pages
from posttrain.generate.paged_attention import (IMPLS, attend_chunk, attend_with_new_token, flat_pages, stacked_pages,
                                               write_layers)
from posttrain.generate.engine.sampling import (filter_logits_rows, pick_tokens, request_rows,  # noqa: F401
                                              stop_rows, token_uniforms, uniform_width)


# decode steps per program by backend (`EngineSettings.decode_chunk` = 0). CPU: 1, a step there is compute-bound
# and a finished slot would idle for the rest of a chunk.
AUTO_DECODE_CHUNK = {"gpu": 8, "tpu": 8, "cpu": 1}
# ... and when no request waits for a slot (`EngineSettings.drain_chunk` = 0): a finished slot has nothing to take
# in then, and the live ones are packed into fewer rows at the next chunk.
AUTO_DRAIN_CHUNK = {"gpu": 8, "tpu": 8, "cpu": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The engine's sizes (static shapes: one decode compile per value). Raises ValueError outside the ranges below.

    Attributes:
        num_slots: S, sequences decoded together (>= 1).
        num_pages: P, pages in the pool including the scratch page 0 (>= 2); KV memory = P * Z tokens per layer.
        page_size: Z, tokens per page (>= 1; the TPU kernel wants a multiple of 16 in bf16).
        max_seq_len: longest prompt + reply in tokens (>= 2); the page-table width M is ceil(max_seq_len / Z).
        prefill_bucket: prefill widths are this times a power of two (>= 1).
        attention_impl: one of `paged_attention.IMPLS` ("auto": a Pallas kernel where `kernel_problems` allows).
        prefix_cache: keep ended sequences' pages across `generate` calls for requests with the same first tokens.
        record_routing: on a MoE model, keep each fed token's expert selections (`Completion.routing`).
        decode_chunk: K, decode steps per program (>= 0; 0: `AUTO_DECODE_CHUNK`); tokens do not depend on K.
        drain_chunk: decode steps per program when no request waits to be admitted (>= 0; 0: `AUTO_DRAIN_CHUNK`)."""

    num_slots: int
    num_pages: int
    page_size: int = 16
    max_seq_len: int = 512
    prefill_bucket: int = 16
    attention_impl: str = "auto"
    prefix_cache: bool = True
    record_routing: bool = False
    decode_chunk: int = 0
    drain_chunk: int = 0

    def __post_init__(self):
        if (self.num_slots < 1 or self.num_pages < 2 or self.page_size < 1 or self.max_seq_len < 2
                or self.prefill_bucket < 1 or self.attention_impl not in IMPLS or self.decode_chunk < 0
                or self.drain_chunk < 0):
            raise ValueError(f"invalid engine settings: num_slots={self.num_slots} (>= 1), num_pages="
                             f"{self.num_pages} (>= 2), page_size={self.page_size} (>= 1), max_seq_len="
                             f"{self.max_seq_len} (>= 2), prefill_bucket={self.prefill_bucket} (>= 1), "
                             f"attention_impl={self.attention_impl!r} (one of {IMPLS}), decode_chunk="
                             f"{self.decode_chunk} (>= 0), drain_chunk={self.drain_chunk} (>= 0)")

    def chunk_steps(self, backend: str | None = None, *, drain: bool = False) -> int:
        """K: decode_chunk (drain_chunk with `drain`), or for 0 the backend's `AUTO_DECODE_CHUNK` (`AUTO_DRAIN_CHUNK`).

        backend: a JAX backend or platform name (default jax.default_backend(); "cuda", "rocm": "gpu"; unlisted: 1)."""
        backend = backend or jax.default_backend()
        backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
        if drain:
            return self.drain_chunk or AUTO_DRAIN_CHUNK.get(backend, 1)
        return self.decode_chunk or AUTO_DECODE_CHUNK.get(backend, 1)

    @property
    def pages_per_seq(self) -> int:
        """M, the page-table width."""
        return -(-self.max_seq_len // self.page_size)

    def table_width(self, pages: int) -> int:
        """The reference's table width for up to `pages` pages: the next of 2, 4, 6, 8, 10, 12, 14, 16, 20, ..., M."""
        width = 2
        while width < pages:
            width += 2 if width < 8 else (1 << (width.bit_length() - 1)) // 4
        return min(width, self.pages_per_seq)

    def decode_rows(self, live: int) -> int:
        """Rows of a decode program over `live` (>= 1) sequences: the next multiple of ceil(S / 4) (S when S <= 8)."""
        quarter = -(-self.num_slots // 4) if self.num_slots > 8 else self.num_slots
        return min(self.num_slots, -(-live // quarter) * quarter)

    def check_requests(self, requests) -> None:
        """Raises TypeError for a non-Request, ValueError for a request over max_seq_len or the pool's pages."""
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"request {i}: expected engine.Request, got {type(r).__name__}")
            total = len(r.prompt) + r.max_new_tokens
            need = -(-total // self.page_size)
            if total > self.max_seq_len or need > self.num_pages - 1:
                raise ValueError(f"request {i}: prompt {len(r.prompt)} + max_new_tokens {r.max_new_tokens} = "
                                 f"{total} tokens ({need} pages of {self.page_size}); the engine holds max_seq_len="
                                 f"{self.max_seq_len} tokens and {self.num_pages - 1} allocatable pages")

    def prefill_width(self, tokens: int) -> int:
        """W of the prefill program for `tokens` new tokens: prefill_bucket * 2^k, the smallest >= tokens."""
        width = self.prefill_bucket
        while width < tokens:
            width *= 2
        return width


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request. Raises ValueError on an empty prompt or values outside the ranges below.

    Attributes:
        prompt, max_new_tokens: token ids (>= 1) and the reply's token budget (>= 1).
        temperature, top_k, top_p: >= 0 (0: greedy), >= 0 (0: off), in (0, 1] (1: off).
        stop_ids: tokens that end the reply (kept as its last token)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.prompt or self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0 \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid request: prompt of {len(self.prompt)} tokens (>= 1), max_new_tokens="
                             f"{self.max_new_tokens} (>= 1), temperature={self.temperature} (>= 0), top_k="
                             f"{self.top_k} (>= 0), top_p={self.top_p} (in (0, 1])")


class Completion(NamedTuple):
    """A request's reply.

    Attributes:
        tokens, logprobs, versions: int32, float32, int32 [n]: each token (the stop token last), its logprob and
            the policy version that produced it.
        truncated: the budget ran out without a stop token.
        preemptions: times it was preempted and recomputed.
        routing: int32 [len(prompt) + n - 1, L, k], each fed token's expert selections (`record_routing`; else None)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    truncated: bool
    preemptions: int
    versions: np.ndarray
    routing: np.ndarray | None = None


def _merge(graphdef, state):
    return nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))


def _decode_once(model, pool, table_SxM, lengths_S, prev_S, impl: str, shared=None):
    """One decode step feeding prev_S at positions lengths_S: (logits [S, V], pool, routed [L, S, k] or None)."""
    P, Z = jax.tree.leaves(pool)[0].shape[2:4]
    S, M = table_SxM.shape
    start_S = 0 if shared is None else jnp.repeat(shared[1], S // shared[1].shape[0])  # tokens before the table
    own_S = lengths_S - start_S
    page_S = table_SxM[jnp.arange(S), jnp.clip(own_S // Z, 0, M - 1)]
    offset_S = lengths_S % Z

    def make_hook(layer, cell):  # cell[0]: the stack's whole pool, one layer of L * P pages, carried by the scan
        def fn(q_Sx1xNxH, own, scale):
            own = {name: e[:, 0] for name, e in own.items()}
            layer_shared = None if shared is None else (shared[0] + layer * P, shared[1])
            out, cell[0] = attend_with_new_token(cell[0], own, q_Sx1xNxH[:, 0], table_SxM + layer * P, own_S,
                                                 page_S + layer * P, offset_S, scale, impl, shared=layer_shared)
            return out[:, None]
        return CacheHook(fn)

    layers = {stack: jnp.arange(_num_layers(p)) for stack, p in pool.items()}
    logits, _, routed, flat = model.decode_with_hook(prev_S, lengths_S, layers, make_hook, return_routing=True,
                                                     cache_carry={k: flat_pages(p) for k, p in pool.items()})
    pool = {stack: stacked_pages(flat[stack], _num_layers(pool[stack])) for stack in pool}
    return logits, pool, routed


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "impl", "routing"), donate_argnames=("pool",))
def decode_chunk(graphdef, state, pool, table_SxM, lengths_S, prev_S, rows, u_KxS, limit_S,
                 stop_SxX, *, steps: int, impl: str, routing: bool = False, shared=None):
    """Up to `steps` (K) decode steps in one program, each slot feeding the token it drew the step before.

    Args:
      limit_S: tokens each slot may draw (0: empty); it also stops at a token of its stop_SxX row (-1: none).
      shared: None, or int32 (prefix_table_BxF, prefix_len_B) for B blocks of rows sharing their first prefix_len_B
        tokens (a multiple of Z; reference only); table_SxM then holds the pages past the prefix.
    Returns:
      (tokens int32 [K, S], logprobs float32 [K, S], drawn bool [K, S], pool, routed int32 [K, S, L, k] or None)."""
    model = _merge(graphdef, state)

    def body(carry, j):
        pool, lengths_S, prev_S, limit_S = carry
        active_S = j < limit_S
        table = jnp.where(active_S[:, None], table_SxM, kv_pages.SCRATCH_PAGE)
        logits, pool, routed = _decode_once(model, pool, table, jnp.where(active_S, lengths_S, 0), prev_S, impl,
                                            shared)
        tok, logp = pick_tokens(logits, rows, u_KxS[j])
        stopped_S = active_S & (tok[:, None] == stop_SxX).any(-1)  # drew a stop token: its limit is what it drew
        carry = (pool, lengths_S + active_S, jnp.where(active_S, tok, prev_S), jnp.where(stopped_S, j + 1, limit_S))
        return carry, (tok, logp, active_S, routed.transpose(1, 0, 2) if routing and routed is not None else None)

    (pool, _, _, _), (tok, logp, drawn, routed) = jax.lax.scan(body, (pool, lengths_S, prev_S, limit_S),
                                                               jnp.arange(steps))
    return tok, logp, drawn, pool, routed


def _num_layers(pool_stack: dict) -> int:
    return next(iter(pool_stack.values())).shape[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "routing"), donate_argnames=("pool",))
def prefill(graphdef, state, pool, tokens_BxW, lengths_B, page_rows_BxM, *, routing: bool = False):
    """Runs B right-padded sequences of `lengths_B` tokens (0: padding) and writes their entries into their pages.

    Returns (logits float32 [B, V] of each row's last token, pool, routed int32 [B, W, L, k] or None)."""
    model = _merge(graphdef, state)
    B, W = tokens_BxW.shape
    pos_BxW = jnp.broadcast_to(jnp.arange(W), (B, W))
    fed_BxW = pos_BxW < lengths_B[:, None]
    h, aux, entries = model.hidden_states(tokens_BxW, None, fed_BxW.astype(jnp.int32), None, return_entries=True)
    return _write_fed(model, pool, h, entries, aux.get("routed_experts"), page_rows_BxM, pos_BxW, fed_BxW,
                      lengths_B, routing)


def _write_fed(model, pool, h, entries, routed, page_rows_BxM, pos_BxW, fed_BxW, length_B, routing: bool):
    """The tail of `prefill` and `extend`: writes the fed tokens' entries, returns (last logits, pool, routed)."""
    B = pos_BxW.shape[0]
    Z = jax.tree.leaves(pool)[0].shape[3]
    page_BxW = jnp.where(fed_BxW, jnp.take_along_axis(page_rows_BxM, jnp.minimum(pos_BxW // Z,
                                                                                 page_rows_BxM.shape[1] - 1), 1),
                         kv_pages.SCRATCH_PAGE)
    pool = {stack: write_layers(pool[stack], {n: e.reshape(e.shape[0], -1, *e.shape[3:])
                                              for n, e in entries[stack].items()},
                                page_BxW.reshape(-1), (pos_BxW % Z).reshape(-1))
            for stack in pool}
    logits = model.logits(h[jnp.arange(B), jnp.maximum(length_B - 1, 0)])
    return logits, pool, (routed.transpose(1, 2, 0, 3) if routing and routed is not None else None)


@functools.partial(jax.jit, static_argnames=("graphdef", "routing"), donate_argnames=("pool",))
def extend(graphdef, state, pool, tokens_BxW, start_B, length_B, page_rows_BxM, *, routing: bool = False):
    """`prefill` of the `length_B` tokens after the first `start_B` of each sequence, which are in its pages."""
    model = _merge(graphdef, state)
    B, W = tokens_BxW.shape
    P = jax.tree.leaves(pool)[0].shape[2]
    pos_BxW = start_B[:, None] + jnp.arange(W)[None, :]
    valid_BxW = jnp.arange(W)[None, :] < length_B[:, None]

    def make_hook(layer, cell):  # cell[0]: the stack's whole pool (carried, read in place, not written here)
        return CacheHook(lambda q, own, scale: attend_chunk(cell[0], own, q, page_rows_BxM + layer * P, start_B,
                                                            scale))

    layers = {stack: jnp.arange(_num_layers(p)) for stack, p in pool.items()}
    h, entries, routed, _ = model.extend_with_hook(tokens_BxW, pos_BxW.astype(jnp.int32), layers, make_hook,
                                                   valid_BxW, return_routing=True,
                                                   cache_carry={k: flat_pages(p) for k, p in pool.items()})
    return _write_fed(model, pool, h, entries, routed, page_rows_BxM, pos_BxW, valid_BxW, length_B, routing)


@functools.partial(jax.jit, donate_argnames=("pool",))
def first_tokens(pool, logits_BxV, src_N, rows, u_N, copy_from_C, copy_to_C):
    """Draws N fresh requests' first tokens and copies pages; returns (token int32 [N], logprob float32 [N], pool).

    Request n draws from logits row src_N[n]; every layer's page copy_to_C[c] becomes a copy of copy_from_C[c]."""
    pool = {stack: {n: x.at[:, :, copy_to_C].set(x[:, :, copy_from_C]) for n, x in p.items()}
            for stack, p in pool.items()}
    tok, logp = pick_tokens(logits_BxV[src_N], rows, u_N)
    return tok, logp, pool


class _Seq:
    """A request in flight: its tokens, logprobs and versions so far, preemptions and admission order."""

    def __init__(self, index: int, request: Request):
        self.index, self.request = index, request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.preemptions, self.order = 0, -1
        self.routing = None  # [cached tokens, L, k] read from the pages when it finishes (record_routing)

    def cached(self) -> list[int]:
        """The tokens its pages hold once prefilled: the prompt and every generated token but the last."""
        return list(self.request.prompt) + self.tokens[:-1]

    def append(self, token, logprob, version: int) -> None:
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self.versions.append(int(version))

    def finished(self) -> bool:
        r = self.request
        return bool(self.tokens) and (self.tokens[-1] in r.stop_ids or len(self.tokens) >= r.max_new_tokens)
