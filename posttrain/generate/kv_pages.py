"""The paged KV cache's bookkeeping: a fixed pool of pages, a page table per engine slot, the allocator and its
counters (host-side NumPy; the page contents live on the device, `posttrain.generate.engine.loop`).

Dimension legend: S slots, M pages per sequence (page-table width), P pages in the pool, Z tokens per page,
L layers of one stack, K kv heads, H head dim, C MLA's compressed entry dims.

Page 0 is the scratch page: never allocated, it backs every page-table entry that holds no page, so inactive
slots and a prefill's padding write there and nothing a live sequence reads is touched. Pages 1..P-1 are
allocated one at a time as a sequence grows (a sequence of n cached tokens holds ceil(n / Z) pages, plus the page
its next token is written to) and released when it ends or is preempted: freed, or kept by the prefix cache
(`posttrain.generate.prefix_cache`), which also lets several slots hold one page. Source: vLLM's PagedAttention (Kwon
et al. 2023, arXiv:2309.06180): blocks allocated on demand, so waste stays under one page per sequence.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SCRATCH_PAGE = 0


class PagePool:
    """Allocator of pages 1..num_pages-1 and the [S, M] page tables of the slots. A page may be held by several
    slots (`share`: a group's prompt pages) and kept after its last holder ends by a `prefix_cache.PrefixCache`
    (`cache`; evicted from it when no page is free). Raises ValueError when num_pages < 2, num_slots < 1 or
    pages_per_seq < 1.
    """

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
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def _take(self) -> int:
        self.allocations += 1
        return self.free_pages.pop() if self.free_pages else self.cache.evict()

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Allocates pages until `slot` holds `num_tokens` tokens (evicting unheld cached pages when none is free);
        False (nothing allocated) when too few are available. Raises ValueError past the page-table width."""
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
        """Drops `slot`'s hold on its pages (its table entries point at the scratch page again); a page no slot
        holds is freed unless the cache keeps it."""
        held = int(self.held_S[slot])
        for p in self.table_SxM[slot, :held][::-1]:
            p = int(p)
            self.ref_P[p] -= 1
            if self.ref_P[p] == 0 and not (self.cache is not None and self.cache.holds(p)):
                self.free_pages.append(p)
        self.table_SxM[slot] = SCRATCH_PAGE
        self.held_S[slot] = 0


def pool_shapes(graphdef, state, num_pages: int, page_size: int) -> dict:
    """{stack: {name: jax.ShapeDtypeStruct}} of the page pool of a model: GQA "k", "v" [K, L, P, Z, H], MLA "kv"
    [1, L, P, Z, C], in the dtype of the model's cache entries (the compute dtype). Read off an abstract
    one-token forward (`jax.eval_shape`: nothing runs). Heads lead and a stack's L layers sit side by side, so
    the pool reads as one layer of L * P pages (`paged_attention.flat_pages`): the kernels take the whole pool
    with page ids offset by layer, and no layer's pages are sliced out (a copy) at any step."""
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
    """Bytes of a page pool (`pool_shapes`)."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for ent in shapes.values() for s in ent.values())


def empty_pool(shapes: dict) -> dict:
    """A zero-filled page pool of `pool_shapes` on the default device."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class PageCounters:
    """The engine's counters (`metrics()` gives the `rollout/...` names). Peak = the step at which most pages
    were allocated (`live_at_peak` sequences holding pages then); `max_waste_per_seq` the largest (allocated -
    used) / sequences holding pages seen at any step: under 1 with one decode step a program, under
    1 + (K - 1) / Z with K (a chunk's pages are allocated before it runs)."""

    def __init__(self, num_slots: int, page_size: int):
        self.num_slots, self.page_size = num_slots, page_size
        self.peak_allocated, self.used_at_peak, self.live_at_peak = 0, 0.0, 0
        self.max_waste_per_seq = 0.0
        self.occupancy_sum, self.steps = 0.0, 0
        self.prefill_tokens = self.decode_tokens = self.preemptions = 0
        self.prefix_cached_tokens = self.weight_swaps = 0

    def observe(self, allocated: int, cached_tokens: int, live: int, holding: int) -> None:
        """Records one decode step: pages allocated, tokens held in them (the fed tokens included), live slots
        (those decoding at this step) and `holding` sequences holding pages (in a decode chunk, a sequence that
        ended at an earlier step of the chunk holds its pages until the chunk ends)."""
        used = cached_tokens / self.page_size
        if allocated >= self.peak_allocated:
            self.peak_allocated, self.used_at_peak, self.live_at_peak = allocated, used, holding
        if holding:
            self.max_waste_per_seq = max(self.max_waste_per_seq, (allocated - used) / holding)
        self.occupancy_sum += live / self.num_slots
        self.steps += 1
        self.decode_tokens += live

    def metrics(self) -> dict[str, float]:
        """rollout/{kv_pages_allocated (peak), kv_pages_used (tokens held / page size, at that peak),
        slot_occupancy (mean live slots / S over decode steps), prefill_tokens, decode_tokens, preemptions,
        prefix_cached_tokens (prompt tokens read from cached pages instead of prefilled), weight_swaps}."""
        return {"rollout/kv_pages_allocated": float(self.peak_allocated),
                "rollout/kv_pages_used": float(self.used_at_peak),
                "rollout/slot_occupancy": self.occupancy_sum / max(self.steps, 1),
                "rollout/prefill_tokens": float(self.prefill_tokens),
                "rollout/decode_tokens": float(self.decode_tokens),
                "rollout/preemptions": float(self.preemptions),
                "rollout/prefix_cached_tokens": float(self.prefix_cached_tokens),
                "rollout/weight_swaps": float(self.weight_swaps)}


class PageRouting:
    """The expert selections of the tokens held in a pool's pages (routing replay, `EngineSettings.record_routing`):
    int32 [P, Z, L, k] host memory, -1 where none was recorded, allocated at the first record (its L, k). A reused
    prefix's selections come with its pages."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.array: np.ndarray | None = None

    def _where(self, pages: PagePool, slots_N, positions_N) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) of each sequence position in its slot's pages."""
        return pages.table_SxM[slots_N, positions_N // self.page_size], positions_N % self.page_size

    def keep(self, pages: PagePool, routed_NxLxk: np.ndarray, slots_N, positions_N) -> None:
        """Stores N fed tokens' selections int32 [N, L, k] at their slots' positions."""
        if self.array is None:
            self.array = np.full((self.num_pages, self.page_size) + routed_NxLxk.shape[1:], -1, np.int32)
        self.array[self._where(pages, slots_N, positions_N)] = routed_NxLxk

    def copy(self, from_C, to_C) -> None:
        """Page to_C[c]'s selections become page from_C[c]'s (the engine's page copies; nothing before a record)."""
        if self.array is not None and len(to_C):
            self.array[to_C] = self.array[from_C]

    def read(self, pages: PagePool, slot: int, num_tokens: int) -> np.ndarray | None:
        """The selections of `slot`'s first num_tokens tokens, int32 [num_tokens, L, k]; None before any record."""
        return None if self.array is None else self.array[self._where(pages, slot, np.arange(num_tokens))]


def kernel_shapes(shapes: dict) -> dict:
    """`paged_attention.kernel_problems` keywords of a pool's first entry ({stack: {name: [K, L, P, Z, H]}}, arrays
    or shapes; every stack's layout is the same): head_dim, page_size, num_kv_heads, dtype."""
    s = next(iter(next(iter(shapes.values())).values()))
    return {"head_dim": s.shape[4], "page_size": s.shape[3], "num_kv_heads": s.shape[0], "dtype": s.dtype}


def shared_blocks(table_NxM: np.ndarray, full_N: np.ndarray, block: int, rows: int):
    """An arrangement of N live sequences into decode rows in blocks of `block` rows that share leading pages (for
    `paged_attention.shared_prefix_attention`: each block's shared pages are read once), or None when it needs
    more than `rows` rows or shares nothing. table_NxM: the sequences' page tables; full_N: their pages that no
    later token is written to (cached tokens // Z: a shared page is full; the page a sequence writes next is its
    own). Sequences whose first page is the same one (a group's prompt) fill blocks together in order, a block per
    `block` of them, so a group's blocks are not mixed with another's; a block shares the leading pages that all
    its sequences hold in the same columns, within every one's full pages. Host NumPy. Returns (row_R: the
    sequence index of each row, -1 for an empty row, R = `rows` rounded up to a multiple of `block`;
    shared_B: pages each of the R / block blocks shares, 0 for empty ones)."""
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
