"""False alarms and power of the paired comparison, measured on one policy's sampled records (issue 22, acceptance 3).

Dimension legend (shape suffixes): N samples of one task (the pool), S seed pairs, M domains.

A **pool** is one evaluation whose every task has N = 2S independent samples at a temperature > 0 (one sampler
call per batch of tasks; each sample is drawn with its own key, so the N samples of a task are independent
draws of the same policy). Seed pair s takes samples 2s and 2s + 1 of every task: two single-sample evaluations
of the same tasks that share no sample, i.e. two independent sampling runs of the same checkpoint, and the S pairs
are independent of each other (disjoint samples). This is what is reused: one sampling pass of N samples per task
stands for 2S sampling runs, which is statistically the same experiment (independent draws from the same
per-task distribution), at one compile and 2S-fold fewer sampler calls.

- **A/A** (the same checkpoint twice): `compare.compare(evaluation 2s, evaluation 2s + 1)`; every verdict other
  than "no change" on any domain is a false alarm. Rate = false alarms / (M x S) domain x seed pairs.
- **Planted regression**: in evaluation 2s + 1 the replies of one domain are replaced by a constant wrong reply
  before scoring and rescored through the domain's environment (`records.rescore`, the `--from_records` path:
  nothing is sampled again); detection = that domain's verdict is "regressed". Rate over the S seeds.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from posttrain.eval import compare as compare_lib
from posttrain.eval import metrics as metrics_lib

PER_SAMPLE = ("replies", "statuses", "rewards", "correct", "formatted", "lengths", "truncated", "turns")


@dataclasses.dataclass(frozen=True)
class PowerResult:
    """The A/A and planted-regression figures of one pool.

    Attributes:
      seeds: S, the seed pairs.
      domains: the M domains compared (sorted).
      false_alarms: {domain: the seeds whose A/A verdict was not "no change"}.
      false_alarm_rate: false alarms / (M x S), in [0, 1].
      planted_domain: the domain whose replies were replaced ("" when none was planted).
      detected: the seeds whose planted domain was "regressed".
      detection_rate: len(detected) / S, in [0, 1] (0.0 when nothing was planted).
      aa_pass_at_1: {domain: the S A/A differences of pass@1 (evaluation 2s + 1 minus 2s)}.
      planted_pass_at_1: the S pass@1 values of the planted domain after rescoring.
    """

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
    """The A/A false-alarm rate and the planted regression's detection rate of `pool` over `seeds` seed pairs
    (module docstring). rescore: records -> records scored again (`records.rescore` with the suite's domains);
    needed with a planted domain. Raises ValueError for a pool with fewer than 2 x seeds samples per task, a
    planted domain not in the pool, or a plant without `rescore`."""
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
