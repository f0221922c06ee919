"""Tickets, outcomes and the retry bookkeeping of the job scheduler (`posttrain.scheduling.scheduler`).

A task visit is one draw of a task for training: G samples, each with an `episode_id` = "run:domain:task
index:visit:sample index". Every run of a sample is one attempt, numbered within the visit (a ticket's samples
share its attempt number), so (episode_id, attempt) keys exactly one archive row. The life of a visit:
  try 0 (the step that drew it) -> an infra-error sample is retried within the step, `retries_per_step` rounds
  with back-off (`SchedulerSettings.backoff`), so its group completes; if one still fails, the whole group leaves
  the batch and the visit is re-queued for the next step as try 1 (all G samples again, next attempt number);
  a visit whose `max_attempts` tries all failed quarantines its task (listed, never drawn again). A breaker's probe
  group tests its domain, not its task: its failure costs the visit no try.
Infra errors are never scored: a group enters the batch only with all G samples scored (docs/design.md invariant 6).

Why not `tenacity`: its `Retrying` calls the function and sleeps itself, while this scheduler is passive (it never
calls a runner; the rollout phase runs tickets, possibly on other hosts or Ray actors), the retry state must be
saved with a checkpoint and survive a resume, and its jittered waits draw from the unseeded `random` module, which
would make the run depend on more than (seed, step, reported costs). The back-off itself is one line.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

INFRA_ERROR = "infra_error"
STATUSES = ("ok", "wrong", "timeout", "memory_limit", "disk_limit", "output_limit", "runtime_error", INFRA_ERROR)


def episode_id(run: str, domain: str, task_index: int, visit: int, sample: int) -> str:
    """The episode id of one sample of a visit: "run:domain:task index:visit:sample index"."""
    return f"{run}:{domain}:{task_index}:{visit}:{sample}"


@dataclasses.dataclass(frozen=True)
class TaskTicket:
    """Work for the rollout phase: run `samples` (indices in 0..G-1) of one visit of a task, after waiting
    `delay_s` seconds (an in-step retry's back-off), and report one `Outcome` per sample.

    ticket_id: unique in the run; step: the step it belongs to; task: the task dict (`TaskSource.get_task`);
    attempt: the attempt number of these sample runs (archive key); try_index: the visit's group try (0: the
    draw, then one per re-queue); retry_round: in-step retry round (0: first run this step); probe: a paused
    domain's probe group."""

    ticket_id: int
    step: int
    run: str
    domain: str
    task_index: int
    visit: int
    samples: tuple[int, ...]
    attempt: int
    try_index: int = 0
    retry_round: int = 0
    delay_s: float = 0.0
    probe: bool = False
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def group_key(self) -> tuple[str, int, int]:
        """(domain, task index, visit): the group the samples belong to."""
        return self.domain, self.task_index, self.visit

    def episode_id(self, sample: int) -> str:
        return episode_id(self.run, self.domain, self.task_index, self.visit, sample)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one sample run of a ticket ended with: status (`envs` statuses: ok | wrong | timeout | memory_limit |
    disk_limit | output_limit | runtime_error | infra_error), reward (ignored for infra_error), cost_s
    (env-reported sandbox CPU seconds, `info["cost"]`)."""

    ticket_id: int
    sample: int
    status: str
    reward: float = 0.0
    cost_s: float = 0.0

    @classmethod
    def from_info(cls, ticket_id: int, sample: int, reward: float, info: Mapping) -> "Outcome":
        """An outcome from an env step's reward and info (`info["status"]`, `info.get("cost", 0)`)."""
        return cls(ticket_id, sample, str(info.get("status", "")), float(reward), float(info.get("cost", 0.0) or 0.0))

    @property
    def infra(self) -> bool:
        return self.status == INFRA_ERROR


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """A visit's try that ended: fate "complete" (all G samples scored: it enters the batch), "requeued" (left
    the batch; tried again next step) or "quarantined" (left the batch; its task is never drawn again).
    attempts / rewards: per sample index, the scored attempt and its reward (complete groups only)."""

    domain: str
    task_index: int
    visit: int
    try_index: int
    fate: str
    attempts: tuple[int, ...] = ()
    rewards: tuple[float, ...] = ()
    probe: bool = False

    @property
    def group_key(self) -> tuple[str, int, int]:
        return self.domain, self.task_index, self.visit


@dataclasses.dataclass(frozen=True)
class ReportResult:
    """What `JobScheduler.report` decided: retries (tickets to run now, in this step, after their delay_s),
    complete groups (train on them) and dropped groups (archive their samples, do not train)."""

    retries: tuple[TaskTicket, ...] = ()
    complete: tuple[GroupResult, ...] = ()
    dropped: tuple[GroupResult, ...] = ()


@dataclasses.dataclass
class OpenGroup:
    """A visit's try in flight: scored {sample: (attempt, reward)}, pending {sample: ticket id}, failed
    {sample: retry round of its last infra error}, next_attempt (the next ticket's attempt number)."""

    domain: str
    task_index: int
    visit: int
    try_index: int
    step: int
    next_attempt: int
    probe: bool = False
    scored: dict = dataclasses.field(default_factory=dict)
    pending: dict = dataclasses.field(default_factory=dict)
    failed: dict = dataclasses.field(default_factory=dict)

    @property
    def group_key(self) -> tuple[str, int, int]:
        return self.domain, self.task_index, self.visit

    def result(self, fate: str, group_size: int) -> GroupResult:
        complete = fate == "complete"
        return GroupResult(self.domain, self.task_index, self.visit, self.try_index, fate,
                           tuple(self.scored[s][0] for s in range(group_size)) if complete else (),
                           tuple(self.scored[s][1] for s in range(group_size)) if complete else (), self.probe)


@dataclasses.dataclass
class Requeued:
    """A visit waiting for a later step: its next try and attempt number, drawable from `ready_step` on."""

    task_index: int
    visit: int
    try_index: int
    attempt: int
    ready_step: int

    def to_json(self) -> list:
        return [self.task_index, self.visit, self.try_index, self.attempt, self.ready_step]


class Breaker:
    """A domain's circuit breaker over its last `window` sample attempts: "closed" (drawn normally) -> "open" (no
    draws) when the window is full and its infra-error rate exceeds `rate` -> after `cooldown` steps one probe
    group ("probing") -> "closed" (window cleared) when the probe's samples all score, else "open" again."""

    def __init__(self, window: int, rate: float, cooldown: int):
        self.window, self.rate, self.cooldown = window, rate, cooldown
        self.state, self.opened_step, self.trips, self.flags = "closed", -1, 0, []

    def record(self, infra: bool) -> None:
        self.flags = (self.flags + [int(infra)])[-self.window:]

    def should_trip(self) -> bool:
        return (self.state == "closed" and len(self.flags) >= self.window
                and sum(self.flags) / len(self.flags) > self.rate)

    def trip(self, step: int) -> None:
        self.state, self.opened_step, self.trips = "open", step, self.trips + 1

    def probe_due(self, step: int) -> bool:
        return self.state == "open" and step >= self.opened_step + self.cooldown

    def probe_result(self, ok: bool, step: int) -> None:
        if ok:
            self.state, self.flags = "closed", []
        else:
            self.state, self.opened_step = "open", step

    def state_dict(self) -> dict:
        return {"state": self.state, "opened_step": self.opened_step, "trips": self.trips, "flags": list(self.flags)}

    def load_state_dict(self, s: Mapping) -> None:
        self.state, self.opened_step, self.trips = str(s["state"]), int(s["opened_step"]), int(s["trips"])
        self.flags = [int(f) for f in s["flags"]]
