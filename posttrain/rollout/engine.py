"""A continuous-batching rollout engine over a paged KV cache (issue 25 items 1, 2 and 7): the host loop.

Dimension legend: S slots, R requests, M pages per sequence, P pages in the pool, Z tokens per page, V vocab.

`Engine(graphdef, state, EngineSettings(...)).generate(requests, key)` -> one `Completion` per request, in
request order; `engine.metrics` then holds `rollout/{kv_pages_allocated, kv_pages_used, slot_occupancy,
prefill_tokens, decode_tokens, preemptions}` of that call (`kv_pages.PageCounters`). Each loop turn:
  1. admit: every free slot takes the next pending request whose pages (its cached tokens + the next one) are
     free, prefills it into them and, for a fresh request, draws its first token from the prefill's logits;
  2. make room: every live slot holds the page its next token goes to; when none is free, the newest sequence
     is preempted (pages freed, queued first for recompute, its tokens and logprobs kept);
  3. decode: one step over all S slots (`engine_ops.decode_step`); finished slots free their pages at once.
The programs and the sampling rule are in `posttrain.rollout.engine_ops` (its module doc).
"""
from __future__ import annotations

import collections
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.rollout import kv_pages
from posttrain.rollout.engine_ops import Completion, EngineSettings, Request, _Seq, decode_step, prefill
from posttrain.rollout.paged_attention import resolve_impl
from posttrain.rollout.sampler import logprob_temperature

__all__ = ["Completion", "Engine", "EngineSettings", "Request"]

def _rows(requests: Sequence[Request | None]) -> dict:
    """The per-row sampling arrays of `engine_ops.pick_tokens` (an empty slot: greedy at T = 1)."""
    def col(fn, dtype):
        return jnp.asarray(np.asarray([fn(r) for r in requests], dtype))

    return {"T": col(lambda r: logprob_temperature(r.temperature) if r else 1.0, np.float32),
            "greedy": col(lambda r: r.temperature == 0 if r else True, bool),
            "top_k": col(lambda r: r.top_k if r else 0, np.int32),
            "top_p": col(lambda r: r.top_p if r else 1.0, np.float32)}


def _cached_len(seq: _Seq) -> int:
    """Tokens its pages hold: the prompt and every generated token but the last (fed at the next step)."""
    return len(seq.request.prompt) + max(len(seq.tokens) - 1, 0)


class Engine:
    """S slots decoding requests from a queue over a page pool (see the module doc).

    Args:
      graphdef, state: the model (`nnx.split` of a `Transformer`; state may be a tuple of states).
      settings: `EngineSettings` (sizes: one decode compile per engine size).
    """

    def __init__(self, graphdef, state, settings: EngineSettings):
        self.graphdef, self.state, self.settings = graphdef, state, settings
        self.shapes = kv_pages.pool_shapes(graphdef, state, settings.num_pages, settings.page_size)
        self.impl = resolve_impl(settings.attention_impl)
        self.metrics: dict[str, float] = {}
        self.max_waste_per_seq = 0.0  # largest (pages allocated - used) / live sequences over the last call
        self.live_at_peak = 0  # live sequences at the last call's step with the most pages allocated

    def check(self, requests: Sequence[Request]) -> None:
        """Raises TypeError for a non-Request, ValueError for a request longer than max_seq_len or needing more
        pages than the pool has (it could never run)."""
        st = self.settings
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"request {i}: expected engine.Request, got {type(r).__name__}")
            total = len(r.prompt) + r.max_new_tokens
            need = -(-total // st.page_size)
            if total > st.max_seq_len or need > st.num_pages - 1:
                raise ValueError(f"request {i}: prompt {len(r.prompt)} + max_new_tokens {r.max_new_tokens} = "
                                 f"{total} tokens ({need} pages of {st.page_size}); the engine holds max_seq_len="
                                 f"{st.max_seq_len} tokens and {st.num_pages - 1} allocatable pages")

    def generate(self, requests: Sequence[Request], key: jax.Array) -> list[Completion]:
        """Completes every request (see the module doc); key: a PRNG key (fresh per call)."""
        self.check(requests)
        st = self.settings
        self._pages = kv_pages.PagePool(st.num_pages, st.num_slots, st.pages_per_seq, st.page_size)
        self._counters = kv_pages.PageCounters(st.num_slots, st.page_size)
        self._pool = kv_pages.empty_pool(self.shapes)
        self._queue = collections.deque(_Seq(i, r) for i, r in enumerate(requests))
        self._slots: list[_Seq | None] = [None] * st.num_slots
        self._done: dict[int, _Seq] = {}
        self._order, self._key = itertools.count(), key
        while self._queue or any(s is not None for s in self._slots):
            self._admit()
            self._make_room()
            if any(s is not None for s in self._slots):
                self._step()
            elif self._queue:  # `check` rules this out: every request fits an empty pool
                raise RuntimeError(f"engine stalled: request {self._queue[0].index} not admitted to an empty pool")
        self.metrics = self._counters.metrics()
        self.max_waste_per_seq = self._counters.max_waste_per_seq
        self.live_at_peak = self._counters.live_at_peak
        self._pool = None  # the pages' memory goes with the call
        out = []
        for i in range(len(requests)):
            seq, r = self._done[i], requests[i]
            truncated = len(seq.tokens) >= r.max_new_tokens and seq.tokens[-1] not in r.stop_ids
            out.append(Completion(np.asarray(seq.tokens, np.int32), np.asarray(seq.logprobs, np.float32),
                                  bool(truncated), seq.preemptions))
        return out

    # ------------------------------------------------------------------ the loop's parts
    def _finish(self, slot: int) -> None:
        seq = self._slots[slot]
        self._pages.release(slot)
        self._slots[slot] = None
        self._done[seq.index] = seq

    def _admit(self) -> None:
        for slot in range(len(self._slots)):
            while self._slots[slot] is None and self._queue:
                seq = self._queue[0]
                if not self._pages.grow(slot, _cached_len(seq) + 1):
                    return  # the pool is full: the queue waits for pages (no preemption to admit)
                self._queue.popleft()
                self._prefill(slot, seq)

    def _prefill(self, slot: int, seq: _Seq) -> None:
        st = self.settings
        cached = list(seq.request.prompt) + seq.tokens[:-1]
        n = len(cached)
        width = st.prefill_bucket
        while width < n:
            width *= 2
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = cached
        tok, lp, self._pool = prefill(self.graphdef, self.state, self._pool, jnp.asarray(tokens), jnp.int32(n),
                                      jnp.asarray(self._pages.table_SxM[slot]), _rows([seq.request]), self._key,
                                      jnp.asarray([seq.index], jnp.int32))
        self._counters.prefill_tokens += n
        seq.order = next(self._order)
        self._slots[slot] = seq
        if not seq.tokens:  # a fresh request: its first token comes from the prefill
            seq.tokens.append(int(tok[0]))
            seq.logprobs.append(float(lp[0]))
            if seq.finished():
                self._finish(slot)

    def _make_room(self) -> None:
        live = sorted((seq.order, s) for s, seq in enumerate(self._slots) if seq is not None)
        for _, slot in live:  # oldest first: the newest are preempted for them
            seq = self._slots[slot]
            while seq is not None and not self._pages.grow(slot, _cached_len(seq) + 1):
                victim = max((q.order, j) for j, q in enumerate(self._slots) if q is not None)[1]
                preempted = self._slots[victim]
                self._pages.release(victim)
                self._slots[victim] = None
                preempted.preemptions += 1
                self._counters.preemptions += 1
                self._queue.appendleft(preempted)
                if victim == slot:
                    seq = None

    def _step(self) -> None:
        slots = self._slots
        lengths = np.asarray([_cached_len(q) if q else 0 for q in slots], np.int32)
        prev = np.asarray([q.tokens[-1] if q else 0 for q in slots], np.int32)
        request = np.asarray([q.index if q else 0 for q in slots], np.int32)
        t = np.asarray([len(q.tokens) if q else 0 for q in slots], np.int32)
        live = sum(q is not None for q in slots)
        self._counters.observe(self._pages.allocated, int(lengths.sum()) + live, live)
        tok, lp, self._pool = decode_step(self.graphdef, self.state, self._pool, jnp.asarray(self._pages.table_SxM),
                                          jnp.asarray(lengths), jnp.asarray(prev),
                                          _rows([q.request if q else None for q in slots]), self._key,
                                          jnp.asarray(request), jnp.asarray(t), impl=self.impl)
        tok, lp = np.asarray(tok), np.asarray(lp)
        for s, seq in enumerate(slots):
            if seq is not None:
                seq.tokens.append(int(tok[s]))
                seq.logprobs.append(float(lp[s]))
                if seq.finished():
                    self._finish(s)
