"""SFT batches: conversations packed into rows (best-fit decreasing) and laid out as a `posttrain.types.RolloutBatch`.

Shapes: the legend in `posttrain.types` (one sample per row). The row layout: docs/algorithms.md.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from posttrain.algos.sft.data import Example
from posttrain.types import RolloutBatch


def best_fit_decreasing(lengths_E: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices summing to <= capacity, best-fit decreasing (Johnson 1973); ValueError for a misfit."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    bad = [(i, n) for i, n in enumerate(lengths_E) if not 1 <= n <= capacity]
    if bad:
        raise ValueError(f"item lengths must be in [1, {capacity}]; (index, length) {bad[:5]}")
    order = sorted(range(len(lengths_E)), key=lambda i: (-lengths_E[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for i in order:
        n = lengths_E[i]
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - n, b))
    return bins


def pack(examples: Sequence[Example], width: int, packing: bool = True) -> list[list[int]]:
    """Rows of example indices: best-fit decreasing into `width` tokens, or one per row; ValueError as the packer."""
    lengths = [len(e.tokens_n) for e in examples]
    if not packing:
        best_fit_decreasing(lengths, width)  # the same checks
        return [[i] for i in range(len(examples))]
    return best_fit_decreasing(lengths, width)


def step_rows(num_rows: int, rows_per_step: int, step: int, seed: int) -> np.ndarray:
    """int [R]: the packed rows of `step`'s batch, each epoch in its own seeded order; ValueError for no rows."""
    if num_rows < 1:
        raise ValueError("no packed rows to draw batches from")
    g = np.arange(step * rows_per_step, (step + 1) * rows_per_step)
    epochs = g // num_rows
    perms = {int(e): np.random.default_rng((seed, int(e))).permutation(num_rows) for e in np.unique(epochs)}
    return np.asarray([perms[int(e)][i] for e, i in zip(epochs, g % num_rows)], np.int64)


def _scored(ex: Example) -> int:
    """Scored slots of an example: its assistant tokens with a position before them."""
    return int(np.count_nonzero(ex.assistant_n[1:]))


def batch_shape(examples: Sequence[Example], rows: Sequence[Sequence[int]], width: int,
                bucket: int = 16) -> tuple[int, int]:
    """(L, C): the longest row's tokens and most scored slots, rounded up to `bucket`, at most `width` (C <= L)."""
    if not rows:
        raise ValueError("batch_shape of no rows")
    up = lambda n: min(width, -(-max(n, 1) // bucket) * bucket)  # noqa: E731
    L = up(max(sum(len(examples[i].tokens_n) for i in row) for row in rows))
    return L, min(L, up(max(sum(_scored(examples[i]) for i in row) for row in rows)))


def make_batch(examples: Sequence[Example], rows: Sequence[Sequence[int]], width: int, pad_id: int,
               num_rows: int | None = None, slots: int | None = None) -> RolloutBatch:
    """The host `RolloutBatch` of `rows` at L = `width`, C = `slots` (default L), padded with empty rows to `num_rows`.

    ValueError for a row longer than `width` or scoring more than C tokens, or more rows than `num_rows`.
    """
    R = len(rows) if num_rows is None else num_rows
    if len(rows) > R:
        raise ValueError(f"{len(rows)} rows do not fit a batch of num_rows={R}")
    L = width
    C = L if slots is None else slots
    tokens = np.full((R, L), pad_id, np.int32)
    positions, segments = np.zeros((R, L), np.int32), np.zeros((R, L), np.int32)
    targets, score_pos = np.zeros((R, C), np.int32), np.zeros((R, C), np.int32)
    mask = np.zeros((R, C), bool)
    truncated = np.zeros(R, bool)
    for r, row in enumerate(rows):
        at, slot = 0, 0
        for k, idx in enumerate(row):
            ex = examples[idx]
            n = len(ex.tokens_n)
            if at + n > L or slot + _scored(ex) > C:
                raise ValueError(f"row {r}: examples {list(row)} hold {sum(len(examples[i].tokens_n) for i in row)} "
                                 f"tokens (width {L}) and score {sum(_scored(examples[i]) for i in row)} (slots {C})")
            tokens[r, at:at + n] = ex.tokens_n
            positions[r, at:at + n] = np.arange(n)
            segments[r, at:at + n] = k + 1
            j = np.flatnonzero(ex.assistant_n[1:]) + 1  # assistant tokens with a position before them
            targets[r, slot:slot + len(j)] = ex.tokens_n[j]
            score_pos[r, slot:slot + len(j)] = at + j - 1
            mask[r, slot:slot + len(j)] = True
            truncated[r] |= ex.truncated
            at, slot = at + n, slot + len(j)
    valid = np.zeros(R, bool)
    valid[:len(rows)] = [len(row) > 0 for row in rows]
    return RolloutBatch(
        tokens_RxL=tokens, positions_RxL=positions, segment_ids_RxL=segments, branch_ids_RxL=np.zeros((R, L), np.int32),
        targets_NxC=targets, score_pos_NxC=score_pos, loss_mask_NxC=mask,
        logp_sample_NxC=np.zeros((R, L), np.float32), advantages_N=np.zeros(R, np.float32),
        rewards_N=np.zeros(R, np.float32), valid_N=valid, truncated_N=truncated,
        group_id_N=np.arange(R, dtype=np.int32))


def eval_batches(examples: Sequence[Example], width: int, rows_per_batch: int, pad_id: int,
                 packing: bool = True, shape: tuple[int, int] | None = None) -> list[RolloutBatch]:
    """Held-out examples packed as in training, `rows_per_batch` rows a batch, all of one (L, C) `shape`."""
    rows = pack(examples, width, packing)
    if not rows:
        return []
    L, C = shape or batch_shape(examples, rows, width)
    return [make_batch(examples, rows[i:i + rows_per_batch], L, pad_id, rows_per_batch, C)
            for i in range(0, len(rows), rows_per_batch)]
