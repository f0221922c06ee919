"""Prefix reuse for the rollout engine (issue 25 item 3): KV pages kept after their sequence ends, found again by
their tokens, keyed by policy version (host-side bookkeeping; the pages live in `kv_pages.PagePool`).

Dimension legend: Z tokens per page, P pages in the pool.

A cached page is an exact trie node at page granularity: a *full* page is keyed by (its parent, its Z tokens),
the parent being the page before it in the sequence, or ("root", policy version) for the first, so a key names
the whole token prefix up to the page's end, with no hashing and no collisions. A *tail* is the partially filled
last page of a sequence that ended (its t < Z tokens), keyed the same way; a later request whose tokens continue
it takes the page over (it becomes that request's own page and leaves the cache: the request writes into it).
Source: vLLM's automatic prefix caching (blocks keyed by their tokens and their prefix) and SGLang's radix cache
(Zheng et al. 2023, arXiv:2312.07104), here at page granularity.

How the engine uses it (`engine.Engine`):
  * a group's G samples: the first sample's prefill registers the prompt's full pages; the others share them
    (reference counts, never written again: a sequence only writes at positions past its cached tokens) and each
    prefills only the prompt's last partial page into a page of its own (copy on write at the first partially
    filled page, by recompute of its < Z tokens; a prompt of a multiple of Z tokens recomputes its last page, so
    that every sample gets the logits of its last prompt token);
  * a multi-turn episode: the ended turn's pages stay cached (full pages and its tail), the next turn's prompt
    matches them and prefills only what follows: the last reply token (its entry was never computed: it would
    have been fed at the next step) and the tokens added since;
  * a weight swap clears the cache (`clear`): entries of one version never serve another.
Pages whose reference count drops to 0 stay cached and are evicted, least recently used leaf first (a page no
other cached page continues), when the pool needs a free page.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class PrefixCache:
    """The cached pages of one policy version (see the module doc). `ref_P`: the pool's reference counts (read
    to find evictable pages). Raises ValueError for a page size < 1."""

    def __init__(self, page_size: int, ref_P: np.ndarray, version: int = 0):
        if page_size < 1:
            raise ValueError(f"prefix cache: page_size={page_size} (>= 1)")
        self.page_size, self.ref_P, self.version = page_size, ref_P, version
        self.full: dict[tuple, int] = {}  # (parent, Z tokens) -> page
        self.tails: dict[object, dict[tuple, int]] = {}  # parent -> {t < Z tokens: page}
        self.key_of: dict[int, tuple] = {}  # page -> its key (full or tail)
        self.children: dict[int, int] = {}  # page -> cached pages (full or tail) continuing it
        self.last_used: dict[int, int] = {}
        self._clock = 0

    def holds(self, page: int) -> bool:
        """Whether `page` is a cache entry (the pool must not free it at reference count 0)."""
        return page in self.key_of

    def _root(self):
        return ("root", self.version)

    def _touch(self, pages: Sequence[int]) -> None:
        self._clock += 1
        for p in pages:
            self.last_used[p] = self._clock

    def match(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int | None, int]:
        """(full pages, tail page or None, tail tokens t) caching the longest prefix of `tokens` of at most `limit`
        tokens: len(full) * Z + t of them. The caller shares the full pages and takes over the tail."""
        Z, parent, full = self.page_size, self._root(), []
        while (len(full) + 1) * Z <= limit:
            page = self.full.get((parent, tuple(tokens[len(full) * Z:(len(full) + 1) * Z])))
            if page is None:
                break
            full.append(page)
            parent = page
        start, best, best_t = len(full) * Z, None, 0
        for tail, page in self.tails.get(parent, {}).items():
            t = len(tail)
            if best_t < t <= limit - start and tuple(tokens[start:start + t]) == tail:
                best, best_t = page, t
        self._touch(full + ([best] if best is not None else []))
        return full, best, best_t

    def take_tail(self, page: int) -> None:
        """Removes tail `page` from the cache (its new owner writes into it)."""
        self._drop(page)

    def register(self, row_M: np.ndarray, tokens: Sequence[int], num_valid: int, *, tail: bool) -> None:
        """Caches the pages of a sequence whose page-table row is `row_M` and whose first `num_valid` tokens have
        their entries in those pages: every full page along the chain (stops at a page whose key another page
        already holds), and with `tail` its partially filled last page (an ended sequence's)."""
        Z, parent = self.page_size, self._root()
        for j in range(num_valid // Z):
            page, key = int(row_M[j]), (parent, tuple(tokens[j * Z:(j + 1) * Z]))
            if self.key_of.get(page) != key:
                if key in self.full or page in self.key_of:
                    return
                self._add(page, key)
                self.full[key] = page
            parent = page
        t = num_valid % Z
        if tail and t:
            page = int(row_M[num_valid // Z])
            key = (parent, tuple(tokens[num_valid - t:num_valid]))
            if page not in self.key_of and key[1] not in self.tails.get(parent, {}):
                self._add(page, key)
                self.tails.setdefault(parent, {})[key[1]] = page

    def _add(self, page: int, key: tuple) -> None:
        self.key_of[page] = key
        self.children.setdefault(page, 0)
        if key[0] != self._root():
            self.children[key[0]] = self.children.get(key[0], 0) + 1
        self._touch([page])

    def _drop(self, page: int) -> None:
        key = self.key_of.pop(page)
        parent, toks = key
        if len(toks) == self.page_size:
            del self.full[key]
        else:
            del self.tails[parent][toks]
            if not self.tails[parent]:
                del self.tails[parent]
        if parent in self.children:
            self.children[parent] -= 1
        self.children.pop(page, None)
        self.last_used.pop(page, None)

    def evict(self) -> int | None:
        """Drops the least recently used cached page that no sequence holds and no cached page continues; returns
        it (the pool frees it), or None when there is none."""
        leaves = [p for p in self.key_of if self.ref_P[p] == 0 and self.children.get(p, 0) == 0]
        if not leaves:
            return None
        page = min(leaves, key=lambda p: self.last_used.get(p, 0))
        self._drop(page)
        return page

    def clear(self, version: int) -> list[int]:
        """Empties the cache for policy `version`; returns the pages it held that no sequence holds (to free)."""
        free = [p for p in self.key_of if self.ref_P[p] == 0]
        self.full, self.tails, self.key_of, self.children, self.last_used = {}, {}, {}, {}, {}
        self.version = version
        return free

    def __len__(self) -> int:
        return len(self.key_of)
