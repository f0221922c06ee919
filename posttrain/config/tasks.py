"""The `tasks` section of a run config: task scheduling over many domains (`posttrain.tasks.jobs.JobScheduler`).

Kept beside `schema.py` (which imports it into `Config`) so that the schema stays one file per screenful of
sections. The values are validated where they become the scheduler's own settings
(`posttrain.recipes.run_plan.scheduler_settings` -> `posttrain.tasks.policy.SchedulerSettings`), with one
ConfigError naming `tasks.<key>`, before any I/O.

Example (a config file)::

    c.tasks.enabled = True
    c.tasks.policies = {"humaneval": {"priority": 1, "max_share": 0.25, "max_env_cpu_s": 60.0,
                                      "max_concurrency": 32},
                        "reasoning_gym/*": {"min_share": 0.005}}
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class TasksConfig:
    """The `tasks` section.

    Attributes:
        enabled: draw training tasks with the job scheduler (policies, retries, quarantine, breaker, band)
            instead of the weighted draw of `posttrain.tasks.scheduler.TaskScheduler`.
        policies: fnmatch pattern of env.train names -> {weight, priority, min_share, max_share, max_env_cpu_s,
            max_concurrency} (`posttrain.tasks.policy.DomainPolicy`; the most specific pattern wins; min_shares
            may sum to at most 1).
        max_attempts: group tries of a task visit before its task is quarantined.
        retries_per_step: in-step retry rounds of an infra-error sample before its group leaves the batch.
        backoff_s: the first in-step retry's wait (seconds); each further round doubles it.
        backoff_max_s: the longest in-step wait (seconds).
        breaker_rate: a domain whose infra-error rate over its last breaker_window sample attempts exceeds this
            is paused (1: never).
        breaker_window: sample attempts in the breaker's window.
        breaker_cooldown_steps: steps a paused domain waits before one probe group.
        band_visits: skip a task whose last this many visits were all correct or all wrong (0: no band).
        band_recheck: the probability that such a task is drawn anyway.
        pass_threshold: reward that counts as correct (band, pass rate).
        cost_ema: weight of a new env cost report in a domain's cost estimate.
        max_credit: the most credit (groups) a domain carries between steps.
    """

    enabled: bool = False
    policies: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    max_attempts: int = 3
    retries_per_step: int = 2
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    breaker_rate: float = 0.5
    breaker_window: int = 32
    breaker_cooldown_steps: int = 5
    band_visits: int = 0
    band_recheck: float = 0.1
    pass_threshold: float = 1.0
    cost_ema: float = 0.2
    max_credit: float = 4.0
