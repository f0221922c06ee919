"""Prefix reuse for the rollout engine: KV pages kept after their sequence ends, found again by their tokens.

Keys, sharing, copy on write and eviction: docs/engine.md.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class PrefixCache:
    """The cached pages of one policy version; `ref_P` is the pool's reference counts. Raises ValueError for Z < 1."""

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
        """(full pages to share, tail page to take over or None, its tokens t) of the longest cached prefix <= limit."""
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
        """Caches the pages of `row_M` holding the first `num_valid` tokens (the partial last one with `tail`)."""
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
        """Drops and returns the least recently used unheld leaf page, or None when there is none."""
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
