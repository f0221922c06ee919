"""Domain policies and the job scheduler's settings: what each domain may take of a step, matched by name pattern.

A policy is attached to a domain by fnmatch pattern (the patterns of `env.domains`), so hundreds of domains need
a few lines. The most specific matching pattern wins: an exact name, else the pattern with the most literal
characters (wildcards `*`, `?` and `[...]` not counted); two equally specific patterns matching one domain are an
error (ConfigDict sorts its keys, so "first listed" cannot be a rule). A domain no pattern matches gets
`DomainPolicy()` (weight 1, priority 0, no guarantee, no cap).

Units: shares are fractions of the slots (prompts = groups) of one `next_tasks` call; `max_env_cpu_s` is sandbox
CPU seconds per step as the env reports them (`info["cost"]`); `max_concurrency` counts samples (sandboxes) in
flight. Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence

from posttrain.config.tasks import SchedulingOptions

_WILDCARDS = re.compile(r"\[[^\]]*\]|\*|\?")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DomainPolicy:
    """What one domain may take of each step.

    Attributes:
        weight: multiplies the domain's mix weight (its env spec's, or the curriculum's); > 0.
        priority: higher priorities are filled first up to their caps (integer; default 0).
        min_share: guaranteed fraction of a step's slots while the domain has tasks, in [0, max_share].
        max_share: the most a domain takes of a step's slots, in (0, 1].
        max_env_cpu_s: env CPU seconds per step, on the domain's cost estimate (0: no cap).
        max_concurrency: samples (sandboxes) in flight at once (0: no cap; else >= the group size).
    Raises ValueError naming the field for a value out of range.
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
    """The job scheduler's settings (`posttrain.scheduling.scheduler.JobScheduler`), built by `recipes/run_plan.py` from the
    config's `tasks` section: its SchedulingOptions (max_attempts, retries_per_step, backoff_s, backoff_max_s,
    breaker_rate, breaker_window, breaker_cooldown_steps, band_visits, band_fail_visits, band_recheck, pass_threshold, cost_ema,
    max_credit; see there) and

    Attributes:
        policies: (fnmatch pattern, DomainPolicy) pairs; the most specific match wins (module docstring).
        group_size: samples per task visit (G).
        seed: the run seed (task order, band re-checks).
        run: the run's name, the first field of every episode id.
    Raises ValueError naming what is out of range.
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

    def backoff(self, retry_round: int) -> float:
        """Seconds to wait before in-step retry round `retry_round` (>= 1): backoff_s * 2**(round - 1), at most
        backoff_max_s; 0 for round 0 (a first try)."""
        return 0.0 if retry_round < 1 else min(self.backoff_max_s, self.backoff_s * 2.0 ** (retry_round - 1))


def specificity(pattern: str) -> int:
    """Literal characters of an fnmatch pattern (wildcards and bracket classes removed)."""
    return len(_WILDCARDS.sub("", pattern))


def resolve_policies(names: Sequence[str], policies: Sequence[tuple[str, DomainPolicy]]) -> dict[str, DomainPolicy]:
    """{domain: its DomainPolicy} by the most specific matching pattern (module docstring).

    Raises ValueError for a pattern that matches no domain, two equally specific patterns matching one domain,
    or min_shares summing to more than 1 over the domains (each domain matched by a pattern gets its min_share).
    """
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
    """(pattern, DomainPolicy) pairs from {pattern: {field: value}} (a config's `tasks.policies`), sorted by
    pattern. Raises ValueError naming the pattern for an unknown field or a value out of range."""
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
