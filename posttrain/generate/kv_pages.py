"""The paged KV cache's host bookkeeping: page allocator, page tables, counters and routing per page (docs/engine.md).

The page contents live on the device. Page 0 is the scratch page, never allocated.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SCRATCH_PAGE = 0


class PagePool:
    """Allocator of pages 1..num_pages-1 (shared by slots, kept by `cache`) and the slots' [S, M] page tables.

    Raises ValueError when num_pages < 2 or another size < 1."""

    def __init__(self, num_pages: int, num_slots: int, pages_per_seq: int, page_size: int):
        if num_pages < 2 or num_slots < 1 or pages_per_seq < 1 or page_size < 1:
            raise ValueError(f"page pool: num_pages={num_pages} (>= 2: page 0 is scratch), num_slots={num_slots}, "
                             f"pages_per_seq={pages_per_seq}, page_size={page_size} (each >= 1)")
        self.num_pages, self.page_size = num_pages, page_size
        self.free_pages = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest id first
        self.table_SxM = np.full((num_slots, pages_per_seq), SCRATCH_PAGE, np.int32)
        self.held_S = np.zeros((num_slots,), np.int32)  # pages held by each slot (its table's first entries)
        self.ref_P = np.zeros((num_pages,), np.int32)  # slots holding each page
        self.cache = None  # a prefix_cache.PrefixCache over ref_P, or None
        self.allocations = 0  # pages handed out (free or evicted) since construction

    @property
    def allocatable(self) -> int:
        """Pages a sequence can ever hold (the pool less the scratch page)."""
        return self.num_pages - 1

    @property
    def allocated(self) -> int:
        """Distinct pages held by slots now (a shared page once)."""
        return int((self.ref_P > 0).sum())

    @property
    def shared_extra(self) -> int:
        """Holdings beyond the first of every page (slot holdings - distinct pages held)."""
        return int(np.maximum(self.ref_P - 1, 0).sum())

    def available(self) -> int:
        """Pages `grow` can hand out now: free ones and cached ones no slot holds."""
        cached = 0 if self.cache is None else sum(1 for p in self.cache.key_of if self.ref_P[p] == 0)
        return len(self.free_pages) + cached

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take(self) -> int:
        self.allocations += 1
        return self.free_pages.pop() if self.free_pages else self.cache.evict()

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Allocates (or evicts) pages until `slot` holds `num_tokens` tokens; False, allocating none, if too few."""
        need = self.pages_for(num_tokens) - int(self.held_S[slot])
        if need <= 0:
            return True
        if self.held_S[slot] + need > self.table_SxM.shape[1]:
            raise ValueError(f"slot {slot}: {num_tokens} tokens need {self.pages_for(num_tokens)} pages, the page "
                             f"table holds {self.table_SxM.shape[1]} (max_seq_len too small)")
        if need > len(self.free_pages) and need > self.available():
            return False
        self._append(slot, [self._take() for _ in range(need)])
        return True

    def share(self, slot: int, pages: list[int]) -> None:
        """Appends held `pages` (cached or another slot's) to `slot`'s table."""
        self._append(slot, pages)

    def _append(self, slot: int, pages: list[int]) -> None:
        start = int(self.held_S[slot])
        for i, p in enumerate(pages):
            self.table_SxM[slot, start + i] = p
            self.ref_P[p] += 1
        self.held_S[slot] += len(pages)

    def release(self, slot: int) -> None:
        """Drops `slot`'s hold on its pages; a page no slot holds is freed unless the cache keeps it."""
        held = int(self.held_S[slot])
        for p in self.table_SxM[slot, :held][::-1]:
            p = int(p)
            self.ref_P[p] -= 1
            if self.ref_P[p] == 0 and not (self.cache is not None and self.cache.holds(p)):
                self.free_pages.append(p)
        self.table_SxM[slot] = SCRATCH_PAGE
        self.held_S[slot] = 0


def pool_shapes(graphdef, state, num_pages: int, page_size: int) -> dict:
    """{stack: {name: ShapeDtypeStruct}} of a model's pool: "k", "v" [K, L, P, Z, H] or MLA "kv" [1, L, P, Z, C]."""
    from flax import nnx

    def entries(state):
        model = nnx.merge(graphdef, *(state if isinstance(state, tuple) else (state,)))
        return model.hidden_states(jnp.zeros((1, 1), jnp.int32), return_entries=True)[2]

    shapes = jax.eval_shape(entries, state)
    out = {}
    for stack, ent in shapes.items():
        out[stack] = {}
        for name, e in ent.items():  # [L, 1, 1, K, H] or [L, 1, 1, C]
            L, tail = e.shape[0], e.shape[3:]
            K, width = (tail[0], tail[1]) if len(tail) == 2 else (1, tail[0])
            out[stack][name] = jax.ShapeDtypeStruct((K, L, num_pages, page_size, width), e.dtype)
    return out


def pool_bytes(shapes: dict) -> int:
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for ent in shapes.values() for s in ent.values())


def empty_pool(shapes: dict) -> dict:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class PageCounters:
    """The engine's counters; `max_waste_per_seq` is the largest (allocated - used) pages per holding sequence."""

    def __init__(self, num_slots: int, page_size: int):
        self.num_slots, self.page_size = num_slots, page_size
        self.peak_allocated, self.used_at_peak, self.live_at_peak = 0, 0.0, 0
        self.max_waste_per_seq = 0.0
        self.occupancy_sum, self.steps = 0.0, 0
        self.prefill_tokens = self.decode_tokens = self.preemptions = 0
        self.prefix_cached_tokens = self.weight_swaps = 0

    def observe(self, allocated: int, cached_tokens: int, live: int, holding: int) -> None:
        """Records one decode step: pages allocated, tokens held in them, live slots and sequences holding pages."""
        used = cached_tokens / self.page_size
        if allocated >= self.peak_allocated:
            self.peak_allocated, self.used_at_peak, self.live_at_peak = allocated, used, holding
        if holding:
            self.max_waste_per_seq = max(self.max_waste_per_seq, (allocated - used) / holding)
        self.occupancy_sum += live / self.num_slots
        self.steps += 1
        self.decode_tokens += live

    def metrics(self) -> dict[str, float]:
        """The call's `rollout/...` metrics; kv_pages_* are read at the step with the most pages allocated."""
        return {"rollout/kv_pages_allocated": float(self.peak_allocated),
                "rollout/kv_pages_used": float(self.used_at_peak),
                "rollout/slot_occupancy": self.occupancy_sum / max(self.steps, 1),
                "rollout/prefill_tokens": float(self.prefill_tokens),
                "rollout/decode_tokens": float(self.decode_tokens),
                "rollout/preemptions": float(self.preemptions),
                "rollout/prefix_cached_tokens": float(self.prefix_cached_tokens),
                "rollout/weight_swaps": float(self.weight_swaps)}


class PageRouting:
    """The expert selections of the tokens in a pool's pages: int32 [P, Z, L, k] on the host, -1 where none."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.array: np.ndarray | None = None

    def _where(self, pages: PagePool, slots_N, positions_N) -> tuple[np.ndarray, np.ndarray]:
        return pages.table_SxM[slots_N, positions_N // self.page_size], positions_N % self.page_size

    def keep(self, pages: PagePool, routed_NxLxk: np.ndarray, slots_N, positions_N) -> None:
        """Stores N fed tokens' selections int32 [N, L, k] at their slots' positions."""
        if self.array is None:
            self.array = np.full((self.num_pages, self.page_size) + routed_NxLxk.shape[1:], -1, np.int32)
        self.array[self._where(pages, slots_N, positions_N)] = routed_NxLxk

    def copy(self, from_C, to_C) -> None:
        """Page to_C[c]'s selections become page from_C[c]'s."""
        if self.array is not None and len(to_C):
            self.array[to_C] = self.array[from_C]

    def read(self, pages: PagePool, slot: int, num_tokens: int) -> np.ndarray | None:
        """The selections of `slot`'s first num_tokens tokens, int32 [num_tokens, L, k]; None before any record."""
        return None if self.array is None else self.array[self._where(pages, slot, np.arange(num_tokens))]


def kernel_shapes(shapes: dict) -> dict:
    """`paged_attention.kernel_problems` keywords (head_dim, page_size, num_kv_heads, dtype) of a pool's entries."""
    s = next(iter(next(iter(shapes.values())).values()))
    return {"head_dim": s.shape[4], "page_size": s.shape[3], "num_kv_heads": s.shape[0], "dtype": s.dtype}


def shared_blocks(table_NxM: np.ndarray, full_N: np.ndarray, block: int, rows: int):
    """Arranges N sequences into blocks of `block` decode rows sharing leading pages (`shared_prefix_attention`).

    full_N: each sequence's full pages (cached tokens // Z). Returns None when it takes more than `rows` rows or
    shares nothing, else (row_R: the sequence of each row, -1 empty; shared_B: pages each block shares)."""
    R = -(-rows // block) * block
    groups: dict[int, list[int]] = {}
    for i in range(table_NxM.shape[0]):
        groups.setdefault(int(table_NxM[i, 0]) if full_N[i] else -1 - i, []).append(i)
    members = [g[j:j + block] for g in groups.values() for j in range(0, len(g), block)]
    if len(members) * block > R:
        return None
    row_R = np.full((R,), -1, np.int64)
    shared_B = np.zeros((R // block,), np.int64)
    for b, seqs in enumerate(members):
        row_R[b * block:b * block + len(seqs)] = seqs
        same = (table_NxM[seqs] == table_NxM[seqs[0]]).all(0)[:int(full_N[seqs].min())]
        shared_B[b] = same.size if same.all() else int(np.argmin(same))
    return (row_R, shared_B) if shared_B.any() else None
