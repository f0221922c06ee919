"""The rollout engine's admission (loop step 1, docs/engine.md): free slots take queued requests and compute them.

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.generate import kv_pages
from posttrain.generate.engine.ops import _Seq, extend, first_tokens, prefill, request_rows


def _cached_len(seq: _Seq) -> int:
    """Tokens its pages hold: the prompt and every generated token but the last (fed at the next step)."""
    return len(seq.request.prompt) + max(len(seq.tokens) - 1, 0)


class Admission:
    """`Engine`'s admission methods (a mixin over the engine's slots, pages, pool, queue and counters)."""

    def _admit(self) -> None:
        """Fills free slots from the queue in rounds until it is empty, no slot is free or the pool is full."""
        while self._queue and None in self._slots:
            admitted, full = [], False
            for slot in range(len(self._slots)):
                if self._slots[slot] is None and self._queue:
                    if not self._claim(slot, self._queue[0]):
                        full = True
                        break
                    admitted.append((slot, self._place(slot, self._queue.popleft())))
            if admitted:
                self._compute(admitted)
            if full or not admitted:
                return

    def _claim(self, slot: int, seq: _Seq) -> bool:
        """Holds `seq`'s pages in `slot` (cached ones first, sets seq.reused); False, holding none, if too few."""
        pages, tokens = self._pages, seq.cached()
        seq.reused = 0
        if pages.cache is not None:  # a fresh request computes >= 1 token: its last prompt token's logits
            full, tail, t = pages.cache.match(tokens, len(tokens) - (0 if seq.tokens else 1))
            pages.share(slot, full)
            if tail is not None:
                pages.cache.take_tail(tail)
                pages.share(slot, [tail])
            seq.reused = len(full) * pages.page_size + t
        if pages.grow(slot, _cached_len(seq) + 1):
            return True
        self._slots[slot] = seq
        self._release(slot, seq.reused)  # what it matched goes back to the cache
        return False

    def _place(self, slot: int, seq: _Seq) -> tuple[int, int]:
        """Puts claimed `seq` in `slot`; returns (start, n): its tokens in pages now and once computed."""
        start, n = seq.reused, _cached_len(seq)
        self._counters.prefill_tokens += n - start
        self._counters.prefix_cached_tokens += start
        if self._pages.cache is not None:
            self._pages.cache.register(self._pages.table_SxM[slot], seq.cached(), n, tail=False)
        seq.order = next(self._order)
        self._slots[slot] = seq
        return start, n

    def _compute(self, admitted: list) -> None:
        """Computes the admitted (slot, (start, n)) and gives each fresh request its first token.

        A fresh request repeating an earlier prompt of the round follows that one (its logits, copies of its pages).
        The rest run as `prefill` / `extend` programs by width, in levels: a sequence reading pages that another
        of the round writes runs in a later program than its writer's."""
        lead_of, followers, programs = {}, collections.defaultdict(list), collections.defaultdict(list)
        Z, writer, level = self._pages.page_size, {}, {}  # page -> the round's slot writing it; slot -> its level
        for slot, (start, n) in admitted:
            row, lead = self._pages.table_SxM[slot], slot
            if not self._slots[slot].tokens:
                lead = lead_of.setdefault(tuple(self._slots[slot].request.prompt), slot)
            if lead != slot:  # a follower's pages are copied from its lead's right after the lead's program
                level[slot] = level[lead]
            else:  # pages it reads that an earlier sequence of this round writes (its prompt's prefix, matched in
                # the cache at `_claim` before they were computed) put it one level after their writers' programs
                level[slot] = max((level[writer[p]] + 1 for p in row[:-(-start // Z)].tolist() if p in writer),
                                  default=0)
            for p in row[start // Z:-(-n // Z)].tolist():
                writer.setdefault(p, slot)
            if lead != slot:
                followers[lead].append((slot, start))
                self._counters.prefill_tokens -= n - start  # copied, not computed
                self._counters.prefix_cached_tokens += n - start
                continue
            if start < n:  # (a recompute whose tokens are all cached computes nothing)
                programs[level[slot], "extend" if start else "prefill", self.settings.prefill_width(n - start)
                         ].append((slot, start, n))
        first = {}
        for (_, kind, width), rows in sorted(programs.items(), key=lambda item: item[0][0]):  # level by level
            first.update(self._first_tokens(self._run(kind, width, rows), rows, followers))
        for slot, _ in admitted:
            seq = self._slots[slot]
            if not seq.tokens:  # a fresh request: its first token comes from the prefill
                seq.append(*first[slot], self.version)
                if seq.finished():
                    self._finish(slot)

    def _run(self, kind: str, width: int, rows: list) -> jax.Array:
        """Runs one `prefill` or `extend` of tokens start..n - 1 of each (slot, start, n); returns logits [B, V]."""
        st, B = self.settings, 1 << (len(rows) - 1).bit_length()
        tokens, start, length = np.zeros((B, width), np.int32), np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        # copies of the page rows: on the CPU a NumPy argument may be read in place (zero-copy) while the program
        # still runs, and the host changes the page table before anything waits for it (a recompute)
        table = np.full((B, st.pages_per_seq), kv_pages.SCRATCH_PAGE, np.int32)
        for i, (slot, s0, n) in enumerate(rows):
            tokens[i, :n - s0] = self._slots[slot].cached()[s0:n]
            start[i], length[i], table[i] = s0, n - s0, self._pages.table_SxM[slot]
        if kind == "prefill":
            logits, self._pool, routed = prefill(self.graphdef, self.state, self._pool, jnp.asarray(tokens),
                                                 jnp.asarray(length), jnp.asarray(table), routing=st.record_routing)
        else:
            logits, self._pool, routed = extend(self.graphdef, self.state, self._pool, jnp.asarray(tokens),
                                                jnp.asarray(start), jnp.asarray(length),
                                                jnp.asarray(self._table(table, max(n for _, _, n in rows))),
                                                routing=st.record_routing)
        if routed is not None:
            routed = np.asarray(routed)
            for i, (slot, s0, n) in enumerate(rows):
                self._keep_routing(routed[i, :n - s0], slot, np.arange(s0, n))
        return logits

    def _first_tokens(self, logits_BxV, rows: list, followers: dict) -> dict:
        """{slot: (token, logprob)} of the fresh requests among `rows` and of their `followers` (by leading slot)."""
        Z, table, picks, copies = self.settings.page_size, self._pages.table_SxM, [], []
        for i, (slot, _, n) in enumerate(rows):
            if self._slots[slot].tokens:
                continue  # a recompute draws nothing
            picks.append((slot, i))
            for f, start in followers.get(slot, ()):
                picks.append((f, i))
                copies += [(table[slot, j], table[f, j]) for j in range(start // Z, -(-n // Z))
                           if table[f, j] != table[slot, j]]
        if not picks:
            return {}
        N, C = 1 << (len(picks) - 1).bit_length(), 1 << max(len(copies) - 1, 0).bit_length()
        src, index = np.zeros((N,), np.int32), np.zeros((N,), np.int32)
        src[:len(picks)] = [i for _, i in picks]
        index[:len(picks)] = [self._slots[s].index for s, _ in picks]
        move = np.full((2, C), kv_pages.SCRATCH_PAGE, np.int32)
        move[:, :len(copies)] = np.asarray(copies, np.int32).reshape(-1, 2).T
        requests = [self._slots[s].request for s, _ in picks] + [None] * (N - len(picks))
        tok, lp, self._pool = first_tokens(self._pool, logits_BxV, jnp.asarray(src), request_rows(requests),
                                           self._uniforms(index, np.zeros_like(index), 1)[0],
                                           jnp.asarray(move[0]), jnp.asarray(move[1]))
        self._routing.copy(move[0, :len(copies)], move[1, :len(copies)])
        tok, lp = np.asarray(tok), np.asarray(lp)
        return {slot: (tok[k], lp[k]) for k, (slot, _) in enumerate(picks)}
