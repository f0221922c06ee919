"""Per-domain scheduler state: per-task statistics and the pass-rate band that skips tasks whose recent visits all
passed or all failed (docs/scheduling.md), counters, JSON form and metrics."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.scheduling.domain_rules import DomainPolicy
from posttrain.scheduling.tickets import Breaker, Requeued

DRAWS, VISITS, MEAN, LAST, STREAK = range(5)


def new_entry() -> list:
    """[draws, visits, mean reward, last visit step (-1: none), streak]."""
    return [0, 0, 0.0, -1, 0]


def record_visit(entry: list, rewards: Sequence[float], step: int, pass_threshold: float) -> list:
    """Updates `entry` in place with one completed visit's G scored rewards; returns it."""
    passes = [float(r) >= pass_threshold for r in rewards]
    visits = entry[VISITS] + 1
    entry[MEAN] += (sum(float(r) for r in rewards) / len(rewards) - entry[MEAN]) / visits
    entry[VISITS], entry[LAST] = visits, int(step)
    streak = entry[STREAK]
    if all(passes):
        entry[STREAK] = streak + 1 if streak > 0 else 1
    elif not any(passes):
        entry[STREAK] = streak - 1 if streak < 0 else -1
    else:
        entry[STREAK] = 0
    return entry


def in_band(entry: list | None, band_visits: int, band_fail_visits: int = -1) -> bool:
    """Whether a task's last band_visits all passed or its last band_fail_visits all failed (band_visits 0: off)."""
    if not band_visits or entry is None:
        return False
    fail = band_visits if band_fail_visits < 0 else band_fail_visits
    streak = entry[STREAK]
    return streak >= band_visits if streak > 0 else bool(fail) and -streak >= fail


def recheck(seed: int, step: int, domain: str, task_index: int, epoch: int, probability: float) -> bool:
    """A deterministic coin with P(True) = probability for one skip decision."""
    if probability <= 0.0:
        return False
    return random.Random(f"{seed}:{step}:{domain}:{task_index}:{epoch}").random() < probability


def should_skip(entry: list | None, settings, step: int, domain: str, task_index: int, epoch: int) -> bool:
    """The band's decision for a fresh draw of `task_index` (settings: a SchedulerSettings)."""
    return in_band(entry, settings.band_visits, settings.band_fail_visits) and not recheck(
        settings.seed, step, domain, task_index, epoch, settings.band_recheck)


def reset(tasks: dict) -> None:
    """Forgets a domain's task statistics, keeping the draw counts (visit numbers are part of episode ids)."""
    for entry in tasks.values():
        entry[VISITS], entry[MEAN], entry[LAST], entry[STREAK] = 0, 0.0, -1, 0


COUNTERS = ("slots", "groups", "complete", "dropped", "episodes", "infra_errors", "retries", "cpu_s", "scored",
            "passes", "fresh", "skipped")
BREAKER_CODES = {"closed": 0.0, "open": 1.0, "probing": 2.0}


@dataclasses.dataclass
class DomainState:
    """One domain's share of the job scheduler's state (`cost`: CPU s per sample, None before a report)."""

    source: Any
    policy: DomainPolicy
    weight: float
    breaker: Breaker
    epoch: int = 0
    index: int = 0
    credit: float = 0.0
    share_carry: float = 0.0
    cost: float | None = None
    in_flight: int = 0
    quarantine: set = dataclasses.field(default_factory=set)
    requeue: list = dataclasses.field(default_factory=list)
    tasks: dict = dataclasses.field(default_factory=dict)
    totals: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    last: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def count(self, key: str, n: float = 1) -> None:
        self.totals[key] += n
        self.last[key] += n

    def state_dict(self) -> dict:
        """JSON-able: everything but the source, the policy, the weight (config) and the last-step counters."""
        return {"cursor": [self.epoch, self.index], "credit": self.credit, "share_carry": self.share_carry,
                "cost": self.cost, "breaker": self.breaker.state_dict(), "quarantine": sorted(self.quarantine),
                "requeue": [r.to_json() for r in self.requeue],
                "tasks": {str(i): list(e) for i, e in sorted(self.tasks.items())}, "totals": dict(self.totals)}

    def load_state_dict(self, s: Mapping) -> None:
        """Restores `state_dict()`. Raises ValueError for a task index outside the source."""
        n = self.source.num_tasks
        indices = [int(i) for i in s["tasks"]] + [int(i) for i in s["quarantine"]] + [r[0] for r in s["requeue"]]
        if any(not 0 <= i < n for i in indices) or not 0 <= int(s["cursor"][1]) < n:
            raise ValueError(f"checkpoint scheduler state names task indices outside [0, {n})")
        self.epoch, self.index = int(s["cursor"][0]), int(s["cursor"][1])
        self.credit, self.share_carry = float(s["credit"]), float(s["share_carry"])
        self.cost = None if s["cost"] is None else float(s["cost"])
        self.breaker.load_state_dict(s["breaker"])
        self.quarantine = {int(i) for i in s["quarantine"]}
        self.requeue = [Requeued(*(int(v) for v in r)) for r in s["requeue"]]
        self.tasks = {int(i): [int(e[0]), int(e[1]), float(e[2]), int(e[3]), int(e[4])] for i, e in s["tasks"].items()}
        self.totals = {k: s["totals"][k] for k in COUNTERS}
        self.last = dict.fromkeys(COUNTERS, 0)

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>/*` metrics of the last step (quarantined and episodes: the run's); rates -1 when unmeasured."""
        last, cap = self.last, self.policy.max_env_cpu_s
        return {f"{prefix}/share": _ratio(last["groups"], last["slots"], 0.0),
                f"{prefix}/quota_used": last["cpu_s"] / cap if cap else 0.0, f"{prefix}/cpu_s": float(last["cpu_s"]),
                f"{prefix}/retries": float(last["retries"]), f"{prefix}/infra_errors": float(last["infra_errors"]),
                f"{prefix}/infra_error_rate": _ratio(last["infra_errors"], last["episodes"]),
                f"{prefix}/pass_rate": _ratio(last["passes"], last["scored"]),
                f"{prefix}/skipped_frac": _ratio(last["skipped"], last["skipped"] + last["fresh"], 0.0),
                f"{prefix}/quarantined": float(len(self.quarantine)),
                f"{prefix}/breaker": BREAKER_CODES[self.breaker.state], f"{prefix}/credit": float(self.credit),
                f"{prefix}/cost_s": -1.0 if self.cost is None else float(self.cost),
                f"{prefix}/episodes": float(self.totals["episodes"])}

    def summary(self) -> dict:
        """The run view of the domain (for `posttrain status`)."""
        t = self.totals
        return {"weight": self.weight * self.policy.weight, "priority": self.policy.priority,
                "share": _ratio(t["groups"], t["slots"], 0.0), "cpu_s": float(t["cpu_s"]),
                "episodes": t["episodes"], "pass_rate": _ratio(t["passes"], t["scored"]),
                "infra_errors": t["infra_errors"], "retries": t["retries"], "dropped_groups": t["dropped"],
                "quarantined": len(self.quarantine), "breaker": self.breaker.state, "cost_s": self.cost}


def _ratio(a: float, b: float, empty: float = -1.0) -> float:
    return float(a) / b if b else empty
