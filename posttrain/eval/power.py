"""False alarms and power of the paired comparison, measured on one policy's sampled records.

Shapes: the legend in `posttrain.types`. The pool of 2S samples per task and the A/A design: docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from posttrain.eval import compare as compare_lib
from posttrain.eval import metrics as metrics_lib

PER_SAMPLE = ("replies", "statuses", "rewards", "correct", "formatted", "lengths", "truncated", "turns")


@dataclasses.dataclass(frozen=True)
class PowerResult:
    """The A/A and planted-regression figures of one pool: the seeds with a false alarm or a detection, and rates."""

    seeds: int
    domains: tuple[str, ...]
    false_alarms: dict[str, list[int]]
    false_alarm_rate: float
    planted_domain: str
    detected: list[int]
    detection_rate: float
    aa_pass_at_1: dict[str, list[float]]
    planted_pass_at_1: list[float]


def pool_size(records: Sequence[Mapping]) -> int:
    """N, the samples every task of the pool has. Raises ValueError for no records or tasks with unequal N."""
    sizes = {len(r["replies"]) for r in records}
    if len(sizes) != 1:
        raise ValueError(f"a pool has the same number of samples for every task, got {sorted(sizes)}")
    return sizes.pop()


def split_sample(records: Sequence[Mapping], j: int) -> list[dict]:
    """The single-sample evaluation of sample j of every task (each per-sample field cut to [j]; greedy False)."""
    out = []
    for r in records:
        one = {k: ([v[j]] if k in PER_SAMPLE and isinstance(v, list) else v) for k, v in r.items()}
        one["greedy"] = False
        out.append(one)
    return out


def plant(records: Sequence[Mapping], domain: str, reply: str) -> list[dict]:
    """The records with every reply of `domain` replaced by `reply` (rewards etc. still those sampled: rescore)."""
    return [{**r, "replies": [reply] * len(r["replies"]), "turns": None} if r["domain"] == domain else dict(r)
            for r in records]


def measure(pool: Sequence[Mapping], *, seeds: int, alpha: float = 0.05, planted_domain: str = "",
            planted_reply: str = "", rescore: Callable[[list[dict]], list[dict]] | None = None,
            n_resamples: int = 999) -> PowerResult:
    """The A/A false-alarm rate and the planted regression's detection rate of `pool` over `seeds` seed pairs.

    rescore (`records.rescore` with the suite's domains) is needed with a plant; ValueError for a small pool.
    """
    n = pool_size(pool)
    if seeds < 1 or n < 2 * seeds:
        raise ValueError(f"{seeds} seed pairs need >= {2 * seeds} samples per task; the pool has {n}")
    domains = tuple(sorted(metrics_lib.by_domain(pool)))
    if planted_domain and (planted_domain not in domains or rescore is None):
        raise ValueError(f"planted_domain={planted_domain!r}: must be one of {list(domains)}, with a rescore function")
    alarms: dict[str, list[int]] = {d: [] for d in domains}
    diffs: dict[str, list[float]] = {d: [] for d in domains}
    detected, planted_p = [], []
    for s in range(seeds):
        a, b = split_sample(pool, 2 * s), split_sample(pool, 2 * s + 1)
        cmp = compare_lib.compare(a, b, alpha=alpha, n_resamples=n_resamples, seed=s)
        for d in cmp.domains:
            diffs[d.domain].append(d.pass_at_1.diff)
            if d.verdict != "no change":
                alarms[d.domain].append(s)
        if planted_domain:
            mine = [r for r in b if r["domain"] == planted_domain]
            replaced = rescore(plant(mine, planted_domain, planted_reply))
            b_planted = [r for r in b if r["domain"] != planted_domain] + replaced
            row = {d.domain: d for d in compare_lib.compare(a, b_planted, alpha=alpha, n_resamples=n_resamples,
                                                            seed=s).domains}[planted_domain]
            planted_p.append(row.pass_at_1.candidate)
            if row.verdict == "regressed":
                detected.append(s)
    total = sum(len(v) for v in alarms.values())
    return PowerResult(seeds, domains, alarms, total / (len(domains) * seeds), planted_domain, detected,
                       len(detected) / seeds if planted_domain else 0.0, diffs, planted_p)
