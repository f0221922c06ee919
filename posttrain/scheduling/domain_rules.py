"""Domain policies and the job scheduler's settings: what each domain may take of a step, by the most specific
matching fnmatch pattern (rules and units: docs/scheduling.md). Pure Python."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence

from typing import Any

from posttrain.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulingOptions:
    """The retry, breaker, band and credit options shared by `TasksConfig` and `SchedulerSettings`.

    Attributes:
        max_attempts: group tries of a task visit (its first try and its re-queues) before its task is quarantined.
        retries_per_step: in-step retry rounds of an infra-error sample before its group leaves the batch.
        backoff_s: the first in-step retry's wait (seconds); each further round doubles it.
        backoff_max_s: the longest in-step wait (seconds).
        breaker_rate: a domain whose infra-error rate over its breaker window exceeds this is paused (1: never).
        breaker_window: sample attempts in the breaker's window (it must be full to trip).
        breaker_cooldown_steps: steps a paused domain waits before one probe group.
        band_visits: skip a task whose last this many visits were all correct or all wrong (0: no band).
        band_fail_visits: the all-wrong side's own count (-1: band_visits; 0: never skip a task for failing).
        band_recheck: the probability that such a task is drawn anyway (a re-check).
        pass_threshold: reward that counts as correct (band, pass rate).
        cost_ema: weight of a new env cost report in a domain's cost estimate (EMA).
        max_credit: the most credit (groups owed or over-served) a domain carries between steps.
    """

    max_attempts: int = 3
    retries_per_step: int = 2
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    breaker_rate: float = 0.5
    breaker_window: int = 32
    breaker_cooldown_steps: int = 5
    band_visits: int = 0
    band_fail_visits: int = -1
    band_recheck: float = 0.1
    pass_threshold: float = 1.0
    cost_ema: float = 0.2
    max_credit: float = 4.0

    def __post_init__(self):
        ints = {k: 1 for k in ("max_attempts", "breaker_window", "breaker_cooldown_steps")}
        ints.update(retries_per_step=0, band_visits=0)
        checks = {**{f"{k} an integer >= {lo}": _is_int(getattr(self, k)) and getattr(self, k) >= lo
                     for k, lo in ints.items()},
                  "0 <= backoff_s <= backoff_max_s": 0.0 <= self.backoff_s <= self.backoff_max_s,
                  "0 < breaker_rate <= 1": 0.0 < self.breaker_rate <= 1.0,
                  "0 <= band_recheck <= 1": 0.0 <= self.band_recheck <= 1.0,
                  "band_fail_visits an integer >= -1": _is_int(self.band_fail_visits) and self.band_fail_visits >= -1,
                  "0 < pass_threshold <= 1": 0.0 < self.pass_threshold <= 1.0,
                  "0 < cost_ema <= 1": 0.0 < self.cost_ema <= 1.0, "max_credit >= 1": self.max_credit >= 1.0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"scheduling options: needs {', '.join(bad)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TasksConfig(SchedulingOptions):
    """The `tasks` section: `SchedulingOptions` plus the switch and the domain policies.

    Attributes:
        enabled: draw training tasks with the job scheduler instead of the weighted draw.
        policies: fnmatch pattern of env.train names -> `DomainPolicy` fields (min_shares sum to at most 1).
    """

    enabled: bool = False
    policies: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)


_WILDCARDS = re.compile(r"\[[^\]]*\]|\*|\?")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DomainPolicy:
    """What one domain may take of each step; ValueError naming a field out of range.

    Attributes:
        weight: multiplies the domain's mix weight (its env spec's, or the curriculum's); > 0.
        priority: higher priorities are filled first up to their caps (integer).
        min_share: guaranteed fraction of a step's slots while the domain has tasks, in [0, max_share].
        max_share: the most a domain takes of a step's slots, in (0, 1].
        max_env_cpu_s: env CPU seconds per step, on the domain's cost estimate (0: no cap).
        max_concurrency: samples (sandboxes) in flight at once (0: no cap; else >= the group size).
    """

    weight: float = 1.0
    priority: int = 0
    min_share: float = 0.0
    max_share: float = 1.0
    max_env_cpu_s: float = 0.0
    max_concurrency: int = 0

    def __post_init__(self):
        checks = {"weight > 0": self.weight > 0, "priority an integer": _is_int(self.priority),
                  "0 <= min_share <= max_share": 0.0 <= self.min_share <= self.max_share,
                  "0 < max_share <= 1": 0.0 < self.max_share <= 1.0, "max_env_cpu_s >= 0": self.max_env_cpu_s >= 0,
                  "max_concurrency an integer >= 0": _is_int(self.max_concurrency) and self.max_concurrency >= 0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"domain policy {self}: needs {', '.join(bad)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSettings(SchedulingOptions):
    """The job scheduler's settings: `SchedulingOptions` plus the fields below (`SchedulerSettings.of`).

    Attributes:
        policies: (fnmatch pattern, DomainPolicy) pairs; the most specific match wins.
        group_size: samples per task visit (G).
        seed: the run seed (task order, band re-checks).
        run: the run's name, the first field of every episode id.
    """

    policies: tuple[tuple[str, DomainPolicy], ...] = ()
    group_size: int = 8
    seed: int = 0
    run: str = "run"

    def __post_init__(self):
        super().__post_init__()
        checks = {"group_size an integer >= 1": _is_int(self.group_size) and self.group_size >= 1,
                  "seed an integer >= 0": _is_int(self.seed) and self.seed >= 0,
                  "run a non-empty string without ':'": isinstance(self.run, str) and bool(self.run)
                  and ":" not in self.run}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"scheduler settings: needs {', '.join(bad)}")
        for pattern, policy in self.policies:
            if not isinstance(pattern, str) or not pattern or not isinstance(policy, DomainPolicy):
                raise ValueError(f"scheduler settings: policies must be (pattern, DomainPolicy) pairs, got "
                                 f"{(pattern, policy)!r}")
            if policy.max_concurrency and policy.max_concurrency < self.group_size:
                raise ValueError(f"policy {pattern!r}: max_concurrency={policy.max_concurrency} is below the group "
                                 f"size {self.group_size}: no group of that domain could ever run")

    @classmethod
    def of(cls, tasks: TasksConfig, domains, *, group_size: int, seed: int, run: str) -> "SchedulerSettings":
        """The settings of the `tasks` section over the env.train `domains`; ConfigError for bad policies."""
        try:
            policies = policies_from_mapping(tasks.policies)
            resolve_policies(list(domains), policies)
            options = {f.name: getattr(tasks, f.name) for f in dataclasses.fields(SchedulingOptions)}
            return cls(policies=policies, group_size=group_size, seed=seed, run=run, **options)
        except ValueError as e:
            raise ConfigError(f"tasks: {e}") from None

    def backoff(self, retry_round: int) -> float:
        """Seconds before in-step retry round `retry_round`: backoff_s * 2**(round - 1) up to backoff_max_s; 0 first."""
        return 0.0 if retry_round < 1 else min(self.backoff_max_s, self.backoff_s * 2.0 ** (retry_round - 1))


def specificity(pattern: str) -> int:
    """Literal characters of an fnmatch pattern (wildcards and bracket classes removed)."""
    return len(_WILDCARDS.sub("", pattern))


def resolve_policies(names: Sequence[str], policies: Sequence[tuple[str, DomainPolicy]]) -> dict[str, DomainPolicy]:
    """{domain: its DomainPolicy} by the most specific matching pattern.

    Raises ValueError for a pattern matching no domain, two equally specific matches, or min_shares summing over 1."""
    policies = list(policies)
    for pattern, _ in policies:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"policy pattern {pattern!r} matches no domain; domains: {sorted(names)}")
    out = {}
    for name in names:
        ranked = sorted(((p == name, specificity(p)), p, pol) for p, pol in policies if fnmatch.fnmatchcase(name, p))
        if len(ranked) > 1 and ranked[-1][0] == ranked[-2][0]:
            raise ValueError(f"domain {name!r}: patterns {ranked[-2][1]!r} and {ranked[-1][1]!r} are equally "
                             "specific; make one of them more specific")
        out[name] = ranked[-1][2] if ranked else DomainPolicy()
    total = sum(p.min_share for p in out.values())
    if total > 1.0 + 1e-9:
        shares = {n: p.min_share for n, p in sorted(out.items()) if p.min_share}
        raise ValueError(f"min_share sums to {total:.6g} > 1 over the domains: {shares}")
    return out


def policies_from_mapping(rules: Mapping[str, Mapping]) -> tuple[tuple[str, DomainPolicy], ...]:
    """(pattern, DomainPolicy) pairs, sorted, from `tasks.policies`; ValueError for a bad field or value."""
    fields = {f.name for f in dataclasses.fields(DomainPolicy)}
    out = []
    for pattern in sorted(rules):
        values = dict(rules[pattern])
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"tasks.policies[{pattern!r}]: unknown field(s) {unknown}; valid: {sorted(fields)}")
        try:
            out.append((pattern, DomainPolicy(**values)))
        except ValueError as e:
            raise ValueError(f"tasks.policies[{pattern!r}]: {e}") from None
    return tuple(out)


