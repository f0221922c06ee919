"""Per-domain scheduler state: the pass-rate band over per-task statistics, counters, JSON form and metrics.

The pass-rate band: per-task statistics let the scheduler skip tasks nothing can be learned from.

A GRPO group whose G rewards are all equal gets advantage 0 (docs/design.md invariant 5): the compute is spent for
nothing. Each task keeps, in its domain's state, one small list [draws, visits, mean reward, last visit step,
streak]: draws counts the visits handed out (the next visit number), visits the completed ones; the streak is +k
after k consecutive visits whose samples all passed (reward >= pass_threshold), -k after k all failed, 0
otherwise. A fresh draw skips a task whose streak >= band_visits or -streak >= band_fail_visits (-1: band_visits;
0: never), except with probability band_recheck (a
re-check: the policy may have changed), decided by a hash of (seed, step, domain, task index, pass), so the skip is
deterministic given the state. Skipped draws are counted (tasks/<domain>/skipped_frac). The band composes with
dynamic sampling (which redraws zero-variance groups after paying for them: the band avoids most of those
payments) and with the curriculum (a level move changes the task source; the statistics of the old level's
tasks no longer match, so `reset` clears them).
"""
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
    """`entry` updated in place by one completed visit's scored rewards (all G of them); returns it."""
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
    """Whether a task's recent visits were all correct (its last band_visits) or all wrong (its last
    band_fail_visits; -1: band_visits, 0: never); band_visits 0: the band is off."""
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
    """Forgets the visit statistics (mean, streak) of a domain's tasks, keeping the draw counts (visit numbers
    must never repeat: they are part of the episode ids)."""
    for entry in tasks.values():
        entry[VISITS], entry[MEAN], entry[LAST], entry[STREAK] = 0, 0.0, -1, 0


COUNTERS = ("slots", "groups", "complete", "dropped", "episodes", "infra_errors", "retries", "cpu_s", "scored",
            "passes", "fresh", "skipped")
BREAKER_CODES = {"closed": 0.0, "open": 1.0, "probing": 2.0}


@dataclasses.dataclass
class DomainState:
    """One domain's share of the job scheduler's state: its task source, resolved policy and mix weight; the
    pass cursor (epoch, index); credit and share carry (`scheduling.quota`); the cost estimate (CPU s per sample;
    None before the first report); samples in flight; breaker; quarantined task indices; re-queued visits; per-task
    entries (above); counters over the run (`totals`) and since the last step began (`last`)."""

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
        """`<prefix>/{share,quota_used,cpu_s,retries,infra_errors,infra_error_rate,pass_rate,skipped_frac,quarantined,
        breaker,credit,cost_s,episodes}`: last step (share of its slots, env CPU s and its fraction of max_env_cpu_s,
        infra-error sample runs, ...) and run totals (quarantined, episodes); rates -1 where nothing was measured."""
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
        """The run view of the domain (for `posttrain status`): policy, run share, episodes, pass rate, infra
        errors, retries, quarantined, breaker, cost."""
        t = self.totals
        return {"weight": self.weight * self.policy.weight, "priority": self.policy.priority,
                "share": _ratio(t["groups"], t["slots"], 0.0), "cpu_s": float(t["cpu_s"]),
                "episodes": t["episodes"], "pass_rate": _ratio(t["passes"], t["scored"]),
                "infra_errors": t["infra_errors"], "retries": t["retries"], "dropped_groups": t["dropped"],
                "quarantined": len(self.quarantine), "breaker": self.breaker.state, "cost_s": self.cost}


def _ratio(a: float, b: float, empty: float = -1.0) -> float:
    return float(a) / b if b else empty
