"""Tickets, outcomes and the retry bookkeeping of the job scheduler: in-step retries, re-queues, quarantine and the
breaker (the life of a visit: docs/scheduling.md)."""
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
    """Work for the rollout phase: run `samples` (0..G-1) of one visit after `delay_s` seconds, report each Outcome.

    try_index: the visit's group try (0: the draw, +1 per re-queue); retry_round: in-step round (0: first run)."""

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
    """What one sample run of a ticket ended with: a status of `STATUSES`, its reward and env CPU seconds."""

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
    """A visit's try that ended: "complete" (enters the batch), "requeued" or "quarantined".

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
    """What `report` decided: retries (to run now, after their delay_s), complete groups and dropped groups."""

    retries: tuple[TaskTicket, ...] = ()
    complete: tuple[GroupResult, ...] = ()
    dropped: tuple[GroupResult, ...] = ()


@dataclasses.dataclass
class OpenGroup:
    """A visit's try in flight: scored {sample: (attempt, reward)}, pending {sample: ticket id}, failed samples."""

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
    """A domain's circuit breaker over its last `window` sample attempts: closed -> open -> probing -> closed."""

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
