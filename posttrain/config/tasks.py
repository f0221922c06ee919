"""The `tasks` section of a run config: task scheduling over many domains (`posttrain.scheduling.scheduler.JobScheduler`).

Kept beside `schema.py` (which imports it into `Config`). The options are validated here (one ConfigError naming
`tasks` at load); the policies where they become the scheduler's own settings
(`posttrain.runs.plan.scheduler_settings` -> `posttrain.scheduling.domain_rules.SchedulerSettings`), resolved against
env.train, before any I/O.

Example (a config file)::

    c.tasks.enabled = True
    c.tasks.policies = {"humaneval": {"priority": 1, "max_share": 0.25, "max_env_cpu_s": 60.0,
                                      "max_concurrency": 32},
                        "reasoning_gym/*": {"min_share": 0.005}}
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulingOptions:
    """The retry, breaker, band and credit options of task scheduling, shared by the config's `tasks` section
    (TasksConfig) and the scheduler's own settings (`posttrain.scheduling.domain_rules.SchedulerSettings`), which extend it.

    Attributes:
        max_attempts: group tries of a task visit (its first try and its re-queues) before its task is quarantined.
        retries_per_step: in-step retry rounds of an infra-error sample before its group leaves the batch.
        backoff_s: the first in-step retry's wait (seconds); each further round doubles it.
        backoff_max_s: the longest in-step wait (seconds).
        breaker_rate: a domain whose infra-error rate over its last breaker_window sample attempts exceeds this
            is paused (1: never).
        breaker_window: sample attempts in the breaker's window (the window must be full to trip).
        breaker_cooldown_steps: steps a paused domain waits before one probe group.
        band_visits: skip a task whose last this many visits were all correct or all wrong (0: no band).
        band_fail_visits: the all-wrong side's own count (-1: band_visits; 0: never skip a task for failing). A
            task failed on its last visits may pass later (the policy learns from other tasks and domains), while a
            passed one rarely fails again, so skipping failures stops the exploration a hard domain learns from.
        band_recheck: the probability that such a task is drawn anyway (a re-check).
        pass_threshold: reward that counts as correct (band, pass rate).
        cost_ema: weight of a new env cost report in a domain's cost estimate (exponential moving average).
        max_credit: the most credit (groups owed or over-served) a domain carries between steps.
    Raises ValueError naming the options out of range.
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
    """The `tasks` section: SchedulingOptions (retries, breaker, band, credit) and

    Attributes:
        enabled: draw training tasks with the job scheduler (policies, retries, quarantine, breaker, band)
            instead of the weighted draw of `posttrain.scheduling.weighted_draw.TaskScheduler`.
        policies: fnmatch pattern of env.train names -> {weight, priority, min_share, max_share, max_env_cpu_s,
            max_concurrency} (`posttrain.scheduling.domain_rules.DomainPolicy`; the most specific pattern wins; min_shares
            may sum to at most 1).
    """

    enabled: bool = False
    policies: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
