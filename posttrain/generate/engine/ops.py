"""The rollout engine's settings, requests and device programs (`posttrain.generate.engine.loop` runs the host loop).

Dimension legend: S slots (sequences decoded together), R requests, M pages per sequence, P pages in the pool,
Z tokens per page, W prefill width, V vocab.

`engine.Engine.generate(requests, key)` keeps S slots decoding: each step feeds every live slot's last token
(`Transformer.decode_with_hook`, attention over pages: `paged_attention.attend_pages`), and a finished slot is
refilled from the queue of pending requests right away (its prompt prefilled into fresh pages), so the batch stays
full while long replies finish. One compile of the decode step per engine size (S, M, P); prefill compiles once
per (rows, width) bucket (rows a power of two <= S). When the pool has no page for a live sequence's next token,
the newest sequence is preempted: its pages are freed and it is queued first for recompute (prompt + its tokens
so far prefilled again, its tokens and logprobs kept), counted in `rollout/preemptions`; a request that could
never fit is a ValueError up front.

Per request: token budget, temperature (0: greedy), top-k, top-p and stop ids. Logprobs are the project's one
definition (docs/design.md invariant 1): `log_softmax(logits / T)` over the full vocabulary with
T = `sampler.logprob_temperature(temperature)`; top-k/top-p only restrict the drawn token. Request r's t-th
token uses the dense sampler's uniform of row r at step t (`engine_sampling.token_uniforms`), whichever slot it
runs in.
A prompt whose first tokens have cached pages (`prefix_cache`: a group's shared prompt, an episode's earlier
turns) prefills only the rest (`extend`: those tokens over the cached pages, `paged_attention.attend_chunk`).
Each token records the policy version whose weights produced it (`Engine.update_weights`).
With `EngineSettings.record_routing` on a MoE model the programs also return the experts each MoE layer selected
for every fed token (routing replay; `Completion.routing`).
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
# (SmolLM2 at 16 slots: tens of ms) and a finished slot would idle for the rest of a chunk.
AUTO_DECODE_CHUNK = {"gpu": 8, "tpu": 8, "cpu": 1}
# ... and when no request waits for a slot (`EngineSettings.drain_chunk` = 0): a finished slot has nothing to take
# in then, and the live ones are packed into fewer rows at the next chunk. CPU: 4 (quickstart shapes, SmolLM2,
# 64 slots, 24 tokens: a call 2.48 -> 2.25 s, the host's per-program work).
AUTO_DRAIN_CHUNK = {"gpu": 8, "tpu": 8, "cpu": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The engine's size (static shapes: one decode compile per value). Raises ValueError on values outside the
    ranges below.

    Attributes:
        num_slots: S, sequences decoded together (>= 1).
        num_pages: P, pages in the pool including the scratch page 0 (>= 2); KV memory = P * Z tokens per layer.
        page_size: Z, tokens per page (>= 1; the TPU kernel wants a multiple of 8 in bf16).
        max_seq_len: longest prompt + reply in tokens (>= 2); the page-table width is ceil(max_seq_len / Z).
        prefill_bucket: prefill widths are this times a power of two (>= 1; fewer compiles).
        attention_impl: `paged_attention.IMPLS` ("auto": the Pallas kernel on TPU / GPU where its constraints hold
            for the model's shapes, `paged_attention.kernel_problems`; the reference elsewhere).
        prefix_cache: keep ended sequences' pages for reuse by later requests with the same first tokens, across
            `generate` calls, and share a group's prompt pages (`prefix_cache` module doc); False frees them.
        record_routing: on a MoE model, keep the experts each MoE layer selected for every token fed to the model
            (`Completion.routing`, routing replay); host memory P * Z * L * k int32. No effect on a dense model.
        decode_chunk: K, decode steps per program (`decode_chunk`: the host returns once per K tokens; >= 0, 0:
            `AUTO_DECODE_CHUNK` of the default backend). Between chunks the engine admits, preempts, swaps
            weights and calls `on_chunk`; a slot that ends inside a chunk stays empty until the chunk ends, and a
            chunk's pages are allocated before it runs (each live slot up to K tokens ahead). K > 1 pays where a
            step's host work is a large share of it (an accelerator: one decode step of qwen3-0.6b at 128 slots on
            an H200 ran 13.6 ms, 7.1 of them device-busy); tokens and logprobs do not depend on K.
        drain_chunk: decode steps per program when no request waits to be admitted (nothing queued, no next turn
            pending): a call's tail, or a call with no more requests than slots (>= 0, 0: `AUTO_DRAIN_CHUNK` of
            the default backend).
    """

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
        """K: decode_chunk, or for 0 `AUTO_DECODE_CHUNK[backend]` (backend: a JAX backend or device platform name,
        "cuda" / "rocm" count as "gpu"; default jax.default_backend(); 1 for any other); with `drain`,
        drain_chunk or `AUTO_DRAIN_CHUNK[backend]` (1 for any other)."""
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
        """The page-table width a program over sequences of at most `pages` pages reads with the gather
        reference: the smallest width >= pages on a grid of 2, 4, 6, 8 pages, then four per octave (10, 12, 14,
        16, 20, 24, 28, 32, 40, ...), at most M (one compile per width). The reference gathers and attends over
        every page of the table it is given (masked past each length), so narrowing the table to what the longest
        live sequence holds cuts the decode step's reads and attention from M * Z keys per slot to at most 4/3 of
        the live ones (2 pages' worth below 8 pages). The Pallas kernels read only each sequence's own pages and
        take the full width (one compile)."""
        width = 2
        while width < pages:
            width += 2 if width < 8 else (1 << (width.bit_length() - 1)) // 4
        return min(width, self.pages_per_seq)

    def decode_rows(self, live: int) -> int:
        """Rows of a decode program over `live` (>= 1) sequences: the smallest multiple of ceil(S / 4) >= live (S
        up to 8: S). The live slots are packed into the first rows, so when slots empty out with nothing queued
        (a call's tail) the decode stops paying for them, as the dense sampler's `shrink`; at most 4 decode
        compiles per table width."""
        quarter = -(-self.num_slots // 4) if self.num_slots > 8 else self.num_slots
        return min(self.num_slots, -(-live // quarter) * quarter)

    def check_requests(self, requests) -> None:
        """Raises TypeError for a non-Request, ValueError for a request longer than max_seq_len or needing more
        pages than the pool has (it could never run)."""
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
        """W of the prefill program for `tokens` new tokens: prefill_bucket times the smallest power of two that
        holds them (one compile per width)."""
        width = self.prefill_bucket
        while width < tokens:
            width *= 2
        return width


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request. Raises ValueError on an empty prompt or values outside the ranges below.

    Attributes:
        prompt: token ids (>= 1 of them).
        max_new_tokens: token budget of the reply (>= 1).
        temperature: logits are divided by it (>= 0; 0: greedy).
        top_k: keep the k most likely tokens when drawing (>= 0; 0: off).
        top_p: nucleus mass kept when drawing (in (0, 1]; 1: off).
        stop_ids: tokens that end the reply (kept as its last token).
    """

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
    """A request's reply: tokens int32 [n] (the stop token last when one came), logprobs float32 [n]
    (`log_softmax(logits / T)` of each token), truncated (budget reached without a stop token), preemptions
    (times it was preempted and recomputed), versions int32 [n] (the policy version that produced each token),
    routing int32 [len(prompt) + n - 1, L, k] (the experts each MoE layer selected for every token fed to the model:
    the prompt and every generated token but the last, as last computed: a recompute after a preemption or a weight
    swap computes them again; `EngineSettings.record_routing` on a MoE model, else None)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    truncated: bool
    preemptions: int
    versions: np.ndarray
    routing: np.ndarray | None = None


def _merge(graphdef, state):
    return nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))


def _decode_once(model, pool, table_SxM, lengths_S, prev_S, impl: str, shared=None):
    """One decode step on a merged model: feeds prev_S at positions lengths_S (each slot's cached tokens) and writes
    their entries into the pages (an inactive slot: length 0 on the scratch page). shared: None, or
    (prefix_table_BxF, prefix_len_B) for rows in B blocks sharing their first prefix_len tokens
    (`paged_attention.shared_prefix_attention`; table_SxM then holds each row's pages past its block's prefix).
    Returns (logits [S, V], pool, routed [L, S, k]: the MoE layers' expert selection of the fed tokens, or None
    without MoE layers)."""
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
    """Up to `steps` (K) decode steps in one program (`_decode_once`, then `pick_tokens`), each slot feeding the
    token it drew at the step before, from prev_S at positions lengths_S, until it has drawn limit_S tokens (0: an
    empty slot; the host's limit is the reply's remaining budget, K and the tokens its pages hold) or a token of
    its stop_SxX row (ids, -1: none). A slot that has stopped feeds nothing more: length 0 on the scratch page,
    as an empty slot. Step j draws with u_KxS[j] (`token_uniforms` of each slot's request and next tokens), so
    the tokens and logprobs do not depend on K. shared: None, or (prefix_table_BxF int32, prefix_len_B int32)
    for rows in B blocks of S / B sharing their first prefix_len_B tokens, a multiple of Z (the gather reference
    only: `shared_blocks`); table_SxM then holds each row's pages past its block's prefix. Returns (tokens int32
    [K, S], logprobs float32 [K, S], drawn bool [K, S]: which slots drew at each step, pool, routed int32
    [K, S, L, k]: the MoE layers' expert selection of the fed tokens with `routing` on a MoE model, else None)."""
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
    """L of a stack's pool ([K, L, P, Z, H])."""
    return next(iter(pool_stack.values())).shape[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "routing"), donate_argnames=("pool",))
def prefill(graphdef, state, pool, tokens_BxW, lengths_B, page_rows_BxM, *, routing: bool = False):
    """Runs B right-padded sequences (`lengths_B` valid tokens each; 0: a padding row, which writes only into the
    scratch page) and writes their entries into their pages (padding into the scratch page). B sequences in one
    program: an admission of several requests is one dispatch (one compile per (B, W) bucket). Returns (logits
    float32 [B, V] of each row's last token (`first_tokens` draws from them), pool, routed): routed int32
    [B, W, L, k], the MoE layers' expert selection of each fed token (padding's: meaningless), with `routing` on a
    MoE model, else None."""
    model = _merge(graphdef, state)
    B, W = tokens_BxW.shape
    pos_BxW = jnp.broadcast_to(jnp.arange(W), (B, W))
    fed_BxW = pos_BxW < lengths_B[:, None]
    h, aux, entries = model.hidden_states(tokens_BxW, None, fed_BxW.astype(jnp.int32), None, return_entries=True)
    return _write_fed(model, pool, h, entries, aux.get("routed_experts"), page_rows_BxM, pos_BxW, fed_BxW,
                      lengths_B, routing)


def _write_fed(model, pool, h, entries, routed, page_rows_BxM, pos_BxW, fed_BxW, length_B, routing: bool):
    """The tail `prefill` and `extend` share: writes the fed tokens' entries (h [B, W, d] hidden states, entries
    {stack: {name: [L, B, W, ...]}}) at their positions pos_BxW into their pages (`page_rows_BxM`; unfed
    tokens into the scratch page) and returns (logits float32 [B, V] at each row's last fed token
    (length_B - 1), pool, routed [B, W, L, k] or None: the MoE layers' [L, B, W, k] selection transposed, with
    `routing`)."""
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
    """`prefill` of B sequences whose first `start_B` tokens are in their pages already: runs each one's
    `length_B` next tokens (right-padded to W; a padding row has length 0 and scratch pages) at positions
    start.., each attending to its cached tokens and causally to its other new ones
    (`paged_attention.attend_chunk`), and writes their entries (padding into the scratch page). One program for
    the turn continuations, recomputes and cached-prefix prompts of an admission round (one compile per (B, W)).
    Returns (logits float32 [B, V] of each row's last new token, pool, routed [B, W, L, k] or None: as
    `prefill`'s)."""
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
    """The first tokens of N fresh requests and the page copies of an admission round: request n draws from row
    src_N[n] of a `prefill` / `extend` program's logits (`pick_tokens` with its own settings `rows` and uniform
    u_N: a group's G samples draw from their prompt's one computation, as the dense sampler's `repeat` of its
    prefill logits), and every layer's page copy_to_C[c] becomes a copy of page copy_from_C[c] (the computed
    prompt's pages that a group's other samples hold copies of: copy on write of a partially filled page;
    padding: the scratch page onto itself). Returns (token int32 [N], logprob float32 [N], pool)."""
    pool = {stack: {n: x.at[:, :, copy_to_C].set(x[:, :, copy_from_C]) for n, x in p.items()}
            for stack, p in pool.items()}
    tok, logp = pick_tokens(logits_BxV[src_N], rows, u_N)
    return tok, logp, pool


class _Seq:
    """A request in flight: its index, settings, tokens, logprobs and versions so far, preemptions, admission
    order."""

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
