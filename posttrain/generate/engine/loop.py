"""The rollout engine's host loop: `Engine` decodes requests from a queue in slots over a paged KV cache.

The loop (swap, admit, make room, decode) is described in docs/engine.md.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import Future
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.generate import kv_pages
from posttrain.generate.engine.ops import (Completion, EngineSettings, Request, _Seq, decode_chunk, request_rows,
                                          stop_rows, token_uniforms, uniform_width)
from posttrain.generate.engine.admission import Admission, _cached_len
from posttrain.generate.paged_attention import resolve_impl
from posttrain.generate.prefix_cache import PrefixCache

__all__ = ["Completion", "Engine", "EngineSettings", "Request", "request_rows"]


class Engine(Admission):
    """S slots decoding requests from a queue over a page pool; `graphdef, state(s)`: `nnx.split` of a `Transformer`."""

    def __init__(self, graphdef, state, settings: EngineSettings, version: int = 0):
        self.graphdef, self.state, self.settings, self.version = graphdef, state, settings, int(version)
        self.shapes = kv_pages.pool_shapes(graphdef, state, settings.num_pages, settings.page_size)
        self.impl = resolve_impl(settings.attention_impl, pages_per_seq=settings.pages_per_seq,
                                 **kv_pages.kernel_shapes(self.shapes))
        self.chunk_steps = settings.chunk_steps()  # K decode steps per program
        self.drain_steps = settings.chunk_steps(drain=True)  # ... when no request waits for a slot
        self.metrics: dict[str, float] = {}
        self.max_waste_per_seq = 0.0  # largest (pages allocated - used) / live sequences over the last call
        self.live_at_peak = 0  # live sequences at the last call's step with the most pages allocated
        self._pending = None  # (state, version) from update_weights, applied at the next chunk
        self._lock = threading.Lock()  # update_weights may run on another thread (the learner's, partial rollouts)
        self._pool = self._pages = self._routing = None

    def update_weights(self, state, version: int) -> None:
        """Sets new weights, in effect from the next decode chunk; safe from another thread or from `on_chunk`.

        Raises ValueError for a state of another structure, shape or dtype than the current one."""
        def sig(tree):
            return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]

        if sig(state) != sig(self.state):
            raise ValueError(f"update_weights: version {version}'s state differs in structure, shapes or dtypes "
                             "from the engine's (a model of another config?)")
        with self._lock:
            self._pending = (state, int(version))

    def clear_cache(self) -> None:
        """Drops the page pool and its prefix cache (their memory); the next `generate` starts empty."""
        self._pool = self._pages = self._routing = None

    def check(self, requests: Sequence[Request]) -> None:
        """Raises as `EngineSettings.check_requests` for requests that could never run."""
        self.settings.check_requests(requests)

    def generate(self, requests: Sequence[Request], key: jax.Array, on_chunk=None, on_finish=None,
                 follow_after: int = 0) -> list[Completion | None]:
        """Completes every request; returns the completions of the requests, then of the follow-ups, by index.

        Args:
          on_chunk: `on_chunk(engine, chunk index)`, called after every decode chunk (e.g. to `update_weights`).
          on_finish: `on_finish(index, completion)`, called as each request ends; it may return the next Request
            (queued first at once, at the next index) or a Future of a Request or None (queued `follow_after` >= 0
            chunks later; its exception is raised; its completion is None when it gave no request)."""
        if follow_after < 0:
            raise ValueError(f"follow_after={follow_after} (>= 0 decode chunks)")
        self._requests, self._on_finish, self._follow_after = list(requests), on_finish, int(follow_after)
        self._waiting: list[tuple[int, int, Future]] = []  # (due chunk, index, Future of its Request or None)
        self.check(requests)
        st = self.settings
        if self._pool is None or not st.prefix_cache or self._pages.allocated:  # (held pages: a call that raised)
            self._pages = kv_pages.PagePool(st.num_pages, st.num_slots, st.pages_per_seq, st.page_size)
            self._pages.cache = PrefixCache(st.page_size, self._pages.ref_P, self.version) if st.prefix_cache \
                else None
            self._pool = kv_pages.empty_pool(self.shapes)
            self._routing = kv_pages.PageRouting(st.num_pages, st.page_size)
        self._counters = kv_pages.PageCounters(st.num_slots, st.page_size)
        self._queue = collections.deque(_Seq(i, r) for i, r in enumerate(requests))
        self._slots: list[_Seq | None] = [None] * st.num_slots
        self._done: dict[int, _Seq] = {}
        self._order, self._key = itertools.count(), key
        prompts = collections.Counter(tuple(r.prompt) for r in requests)
        self._block = max(prompts.values(), default=1)  # a group's samples: rows per shared-prefix block
        for chunk in itertools.count():
            self._chunk = chunk
            self._take_follow_ups(chunk)
            if not (self._queue or self._waiting or any(s is not None for s in self._slots)):
                break
            self._swap()
            self._admit()
            self._make_room()
            if any(s is not None for s in self._slots):
                self._step()
                if on_chunk is not None:
                    on_chunk(self, chunk)
            elif self._queue:  # `check` rules this out: every request fits an empty pool
                raise RuntimeError(f"engine stalled: request {self._queue[0].index} not admitted to an empty pool")
        self._swap()  # a swap asked for during the last chunk: in effect for the next call
        self.metrics = self._counters.metrics()
        self.max_waste_per_seq = self._counters.max_waste_per_seq
        self.live_at_peak = self._counters.live_at_peak
        if not st.prefix_cache:
            self.clear_cache()  # the pages' memory goes with the call
        return [None if r is None else self._completion(self._done[i], r) for i, r in enumerate(self._requests)]

    @staticmethod
    def _completion(seq: _Seq, r: Request) -> Completion:
        truncated = len(seq.tokens) >= r.max_new_tokens and seq.tokens[-1] not in r.stop_ids
        return Completion(np.asarray(seq.tokens, np.int32), np.asarray(seq.logprobs, np.float32), bool(truncated),
                          seq.preemptions, np.asarray(seq.versions, np.int32), seq.routing)

    def _table(self, table_xM: np.ndarray, tokens: int) -> np.ndarray:
        """A copy of the page table cut to `EngineSettings.table_width` for the reference, whole for the kernels."""
        if self.impl != "reference":
            return table_xM.copy()
        return table_xM[..., :self.settings.table_width(-(-tokens // self.settings.page_size))].copy()

    def _shared_tables(self, table_RxM: np.ndarray, tokens_R: np.ndarray, shared_B):
        """(row tables, None), or with `shared_B` (tables past the shared pages, (shared [B, F], tokens [B]))."""
        if shared_B is None:
            return jnp.asarray(self._table(table_RxM, int(tokens_R.max()))), None
        Z, G = self.settings.page_size, self._block
        F = self.settings.table_width(int(shared_B.max()))
        prefix = np.full((len(shared_B), F), kv_pages.SCRATCH_PAGE, np.int32)
        own = np.full_like(table_RxM, kv_pages.SCRATCH_PAGE)
        for b, n in enumerate(shared_B):
            prefix[b, :n] = table_RxM[b * G, :n]
            own[b * G:(b + 1) * G, :table_RxM.shape[1] - n] = table_RxM[b * G:(b + 1) * G, n:]
        need = int((-(-tokens_R // Z) - np.repeat(shared_B, G)).max())
        own = own[:, :self.settings.table_width(max(need, 1))]
        return jnp.asarray(own), (jnp.asarray(prefix), jnp.asarray(shared_B * Z, np.int32))

    def _uniforms(self, request_S: np.ndarray, t_S: np.ndarray, steps: int) -> jax.Array:
        return token_uniforms(self._key, jnp.asarray(request_S, jnp.int32), jnp.asarray(t_S, jnp.int32), steps=steps,
                              width=uniform_width(int(np.max(request_S))))

    def _keep_routing(self, routed_NxLxk, slots_N, positions_N) -> None:
        """Stores the expert selections of N fed tokens at their pages (`record_routing`; None: nothing)."""
        if routed_NxLxk is not None:
            self._routing.keep(self._pages, np.asarray(routed_NxLxk), slots_N, positions_N)

    def _release(self, slot: int, num_valid: int | None = None) -> None:
        """Frees `slot`; its pages and their first `num_valid` tokens (default: all) go to the prefix cache."""
        seq, pages = self._slots[slot], self._pages
        if pages.cache is not None:
            n = _cached_len(seq) if num_valid is None else num_valid
            pages.cache.register(pages.table_SxM[slot], seq.cached(), n, tail=True)
        pages.release(slot)
        self._slots[slot] = None

    def _finish(self, slot: int) -> None:
        seq = self._done[self._slots[slot].index] = self._slots[slot]
        seq.routing = self._routing.read(self._pages, slot, _cached_len(seq))
        self._release(slot)
        follow = self._on_finish(seq.index, self._completion(seq, seq.request)) if self._on_finish else None
        if isinstance(follow, Future):
            self._waiting.append((self._chunk + self._follow_after, len(self._requests), follow))
            self._requests.append(None)
        elif follow is not None:
            self._requests.append(None)
            self._queue_follow_up(len(self._requests) - 1, follow)

    def _queue_follow_up(self, index: int, follow: Request) -> None:
        self.check([follow])
        self._queue.appendleft(_Seq(index, follow))
        self._requests[index] = follow

    def _take_follow_ups(self, chunk: int) -> None:
        """Queues the Futures' requests due by `chunk` (the earliest due ones when nothing else is left to decode)."""
        if not self._waiting:
            return
        if not (self._queue or any(s is not None for s in self._slots)):
            chunk = max(chunk, self._waiting[0][0])
        due = [w for w in self._waiting if w[0] <= chunk]
        self._waiting = [w for w in self._waiting if w[0] > chunk]
        for _, index, future in due:
            follow = future.result()
            if follow is not None:
                self._queue_follow_up(index, follow)

    def _swap(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self.state, self.version = pending
        live = sorted((seq.order, s) for s, seq in enumerate(self._slots) if seq is not None)
        for _, slot in reversed(live):  # requeued oldest first, ahead of the pending requests
            self._queue.appendleft(self._slots[slot])
            self._pages.release(slot)
            self._slots[slot] = None
        if self._pages.cache is not None:
            self._pages.free_pages.extend(self._pages.cache.clear(self.version))
        self._counters.weight_swaps += 1

    def _make_room(self) -> None:
        live = sorted((seq.order, s) for s, seq in enumerate(self._slots) if seq is not None)
        for _, slot in live:  # oldest first: the newest are preempted for them
            seq = self._slots[slot]
            while seq is not None and not self._pages.grow(slot, _cached_len(seq) + 1):
                victim = max((q.order, j) for j, q in enumerate(self._slots) if q is not None)[1]
                preempted = self._slots[victim]
                self._release(victim)
                preempted.preemptions += 1
                self._counters.preemptions += 1
                self._queue.appendleft(preempted)
                if victim == slot:
                    seq = None

    def _step(self) -> None:
        """One decode chunk over the live slots, each drawing up to K tokens (what its pages can be grown to hold).

        With the reference and a repeated prompt, rows come in blocks sharing their prompt pages (`shared_blocks`)."""
        st = self.settings
        K = self.chunk_steps if self._queue or self._waiting or self._on_finish else self.drain_steps
        live = [s for s, q in enumerate(self._slots) if q is not None]
        cached = {s: _cached_len(self._slots[s]) for s in live}
        want = {}
        for s in live:
            q = self._slots[s]
            want[s] = min(K, q.request.max_new_tokens - len(q.tokens))
            if want[s] > 1 and not self._pages.grow(s, cached[s] + want[s]):  # `_make_room` holds one
                want[s] = min(want[s], int(self._pages.held_S[s]) * st.page_size - cached[s])
        R = st.decode_rows(len(live))
        blocks = None
        if self.impl == "reference" and self._block > 1:
            blocks = kv_pages.shared_blocks(self._pages.table_SxM[live],
                                            np.asarray([cached[s] // st.page_size for s in live]), self._block, R)
        row_slot = [live[i] if i >= 0 else -1 for i in blocks[0]] if blocks else live + [-1] * (R - len(live))
        seqs = [self._slots[s] if s >= 0 else None for s in row_slot]
        lengths = np.asarray([cached[s] if s >= 0 else 0 for s in row_slot], np.int32)
        limit = np.asarray([want[s] if s >= 0 else 0 for s in row_slot], np.int32)
        prev = np.asarray([q.tokens[-1] if q else 0 for q in seqs], np.int32)
        request = np.asarray([q.index if q else 0 for q in seqs], np.int32)
        t = np.asarray([len(q.tokens) if q else 0 for q in seqs], np.int32)
        stop = stop_rows([q.request.stop_ids if q else () for q in seqs])
        table = np.full((len(row_slot), st.pages_per_seq), kv_pages.SCRATCH_PAGE, np.int32)  # a copy (`_run`)
        for i, s in enumerate(row_slot):
            if s >= 0:
                table[i] = self._pages.table_SxM[s]
        table, prefix = self._shared_tables(table, lengths + limit, blocks[1] if blocks else None)
        tok, lp, drawn, self._pool, routed = decode_chunk(
            self.graphdef, self.state, self._pool, table, jnp.asarray(lengths), jnp.asarray(prev),
            request_rows([q.request if q else None for q in seqs]), self._uniforms(request, t, K),
            jnp.asarray(limit), jnp.asarray(stop), steps=K, impl=self.impl, routing=st.record_routing, shared=prefix)
        tok, lp, drawn = np.asarray(tok), np.asarray(lp), np.asarray(drawn)
        shared = self._pages.shared_extra * st.page_size  # shared pages counted once
        written_KxR = lengths + np.cumsum(drawn, axis=0)  # tokens in each row's pages after each step
        for j in range(K):
            if drawn[j].any():
                self._counters.observe(self._pages.allocated, int(written_KxR[j][limit > 0].sum()) - shared,
                                       int(drawn[j].sum()), int((limit > 0).sum()))
        if routed is not None:
            routed = np.asarray(routed)
            for j in range(K):
                rows = np.flatnonzero(drawn[j])
                self._keep_routing(routed[j][rows], np.asarray(row_slot)[rows], lengths[rows] + j)
        for i, s in enumerate(row_slot):
            if s < 0:
                continue
            for j in np.flatnonzero(drawn[:, i]):
                seqs[i].append(tok[j, i], lp[j, i], self.version)
            if seqs[i].finished():
                self._finish(s)
