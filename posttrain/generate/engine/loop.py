"""A continuous-batching rollout engine over a paged KV cache (issue 25 items 1, 2 and 7): the host loop.

Dimension legend: S slots, R requests, M pages per sequence, P pages in the pool, Z tokens per page, V vocab.

`Engine(graphdef, state, EngineSettings(...)).generate(requests, key)` -> one `Completion` per request, in
request order; `engine.metrics` then holds `rollout/{kv_pages_allocated, kv_pages_used, slot_occupancy,
prefill_tokens, decode_tokens, preemptions, prefix_cached_tokens, weight_swaps}` of that call
(`kv_pages.PageCounters`). With `EngineSettings.record_routing` on a MoE model each fed token's expert selections
are kept per page (host memory, like the pool: a reused prefix's come with its pages) and read into
`Completion.routing` as a sequence ends. Each loop turn (a decode chunk: K = `EngineSettings.decode_chunk` steps;
`drain_chunk` steps when no request waits for a slot and no `on_finish` can queue one):
  0. swap: weights given to `update_weights(state, version)` since the last turn take effect; every live sequence
     is requeued for recompute under them (its cached pages were computed by the old weights) and the prefix
     cache is cleared, so every token from then on is exactly the new version's (`Completion.versions`);
  1. admit (`engine_admission.Admission`): every free slot takes the next pending request whose pages (its
     cached tokens + the next one) are free; the first tokens that the prefix cache holds (`prefix_cache`) are
     shared, the rest computed into fresh pages: one `prefill` program per width for the sequences with nothing
     cached, one batched `extend` per width past cached ones. Fresh requests with the same prompt (a group's G
     samples) compute it once: `first_tokens` draws every sample's first token from that computation's logits
     and gives the others copies of its pages past those the prefix cache shares (copy on write);
     requests that end at their first token free their slots for another round;
  2. make room: every live slot holds the page its next token goes to; when none is free, the newest sequence
     is preempted (pages freed, queued first for recompute, its tokens and logprobs kept);
  3. decode: K steps over the live slots, packed into the first `EngineSettings.decode_rows` rows of one program
     (`engine_ops.decode_chunk`; each live slot's pages grown
     for its next K tokens where the pool has them, else it stops at what they hold); finished slots release
     their pages when the chunk ends
     (kept by the prefix cache for a later turn), `on_finish` may queue the episode's next turn at once, or
     return a Future of it (its env steps on another thread meanwhile): the turn is queued `follow_after`
     chunks later (waiting for the Future then if it is not done), so the order is the same however long
     the env takes;
     then `on_chunk(engine, chunk)` if given.
With `EngineSettings.prefix_cache` the page pool and its cache live across `generate` calls (`clear_cache`).
The programs and the sampling rule are in `posttrain.generate.engine.ops` (its module doc).
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
    """S slots decoding requests from a queue over a page pool (see the module doc).

    Args:
      graphdef, state: the model (`nnx.split` of a `Transformer`; state may be a tuple of states).
      settings: `EngineSettings` (sizes: one decode compile per engine size).
    """

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
        """New weights (same structure, shapes and dtypes as the current state: no recompile) and their policy
        version; they take effect at the next decode chunk (module doc, step 0), or at the next `generate`.
        Safe to call from another thread or from `generate`'s `on_chunk`. Raises ValueError for a state of
        another structure, shape or dtype."""
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
        """`EngineSettings.check_requests`: TypeError, ValueError for requests that could never run."""
        self.settings.check_requests(requests)

    def generate(self, requests: Sequence[Request], key: jax.Array, on_chunk=None, on_finish=None,
                 follow_after: int = 0) -> list[Completion | None]:
        """Completes every request (see the module doc); key: a PRNG key (fresh per call); on_chunk(engine,
        chunk index): called after every decode chunk (e.g. to `update_weights`); on_finish(index, completion):
        called as each request ends (per-episode multi-turn: step its env there), may return the episode's next
        Request, queued first at once (index: the next one after all so far; it finds its earlier turns' pages
        in the prefix cache) while the other requests keep decoding, or a `concurrent.futures.Future` of that
        Request or None: it takes the next index at once and is queued `follow_after` (>= 0) decode chunks later,
        when `generate` waits for the Future if it is not done (at once when nothing else is left to decode);
        its exception is raised. Returns the completions of the requests and then of the returned ones, by
        index (None at a Future's index that gave no request)."""
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
        """A copy of the page table (or one row) as wide as a program over sequences of at most `tokens` tokens
        reads (`EngineSettings.table_width`: the gather reference) or whole (the kernels)."""
        if self.impl != "reference":
            return table_xM.copy()
        return table_xM[..., :self.settings.table_width(-(-tokens // self.settings.page_size))].copy()

    def _shared_tables(self, table_RxM: np.ndarray, tokens_R: np.ndarray, shared_B):
        """The decode program's page tables: (`_table` of the rows, None), or with `shared_B` (pages each block of
        `_block` rows shares, `kv_pages.shared_blocks`) (each row's table past its block's shared pages, (the
        blocks' shared pages [B, F], their tokens [B])), F and the row tables' widths on `table_width`'s grid."""
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
        """float32 [steps, S]: the uniforms of each row's next `steps` tokens (`engine_sampling.token_uniforms`)."""
        return token_uniforms(self._key, jnp.asarray(request_S, jnp.int32), jnp.asarray(t_S, jnp.int32), steps=steps,
                              width=uniform_width(int(np.max(request_S))))

    def _keep_routing(self, routed_NxLxk, slots_N, positions_N) -> None:
        """Stores the expert selections of N fed tokens at their pages (`record_routing`; None: nothing)."""
        if routed_NxLxk is not None:
            self._routing.keep(self._pages, np.asarray(routed_NxLxk), slots_N, positions_N)

    # ------------------------------------------------------------------ the loop's parts
    def _release(self, slot: int, num_valid: int | None = None) -> None:
        """Frees `slot`; its pages go to the prefix cache (full pages and its partial last page) with their first
        `num_valid` tokens (default: all its cached tokens)."""
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
        """Queues the Futures' requests due by `chunk` (all those of the earliest due chunk when nothing else is
        left to decode), in the order their replies ended."""
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
        """One decode chunk over the live slots, compacted into `EngineSettings.decode_rows` rows (empty rows
        pad): each live slot draws up to K tokens (its remaining budget, and the tokens its pages hold after it
        tries to grow them for K more without preempting anyone). With the gather reference and a call whose
        requests repeat a prompt (a group's samples), rows come in blocks of the group size that read their shared
        prompt pages once (`kv_pages.shared_blocks`), when that takes no more rows."""
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
