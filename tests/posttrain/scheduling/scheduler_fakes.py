"""Test doubles of the job scheduler's tests: tiny task sources and a fake runner that drives the scheduler the way
the rollout phase does (tickets -> outcomes -> report -> in-step retries), with fixed env costs per domain, seeded
infra errors and per-task pass probabilities, recording every sample attempt and the in-flight peaks."""
from __future__ import annotations

import collections
import dataclasses
import random

from posttrain.scheduling.tickets import Outcome


class Source:
    """`n` tasks {"id": "<tag>-<i>"}."""

    def __init__(self, n: int, tag: str):
        self.num_tasks, self.tag = n, tag

    def get_task(self, i: int) -> dict:
        return {"id": f"{self.tag}-{i}"}


def coin(*key) -> float:
    """A deterministic uniform in [0, 1) of `key`."""
    return random.Random(":".join(map(str, key))).random()


@dataclasses.dataclass
class Attempt:
    """One sample run as the runner saw it."""

    ticket: object
    sample: int
    status: str
    reward: float
    cost_s: float


@dataclasses.dataclass
class StepLog:
    tickets: list  # the step's first tickets (next_tasks)
    attempts: list  # every Attempt of the step, retries included
    complete: list  # GroupResults that enter the batch
    dropped: list
    peak_in_flight: dict  # domain -> most samples in flight at once this step
    rounds: int = 0


class FakeRunner:
    """Runs a JobScheduler's tickets. costs: {domain: CPU s per sample}; infra: {domain: P(infra_error) per
    attempt}; pass_prob(domain, task index, sample) -> P(reward 1) (default 0.5)."""

    def __init__(self, sched, costs=None, infra=None, pass_prob=None, seed: int = 0):
        self.sched, self.seed = sched, seed
        self.costs, self.infra = dict(costs or {}), dict(infra or {})
        self.pass_prob = pass_prob or (lambda d, i, s: 0.5)
        self.logs: list[StepLog] = []

    def outcome(self, t, s) -> Attempt:
        key = (self.seed, t.episode_id(s), t.attempt)
        cost = self.costs.get(t.domain, 0.0)
        if coin("infra", *key) < self.infra.get(t.domain, 0.0):
            return Attempt(t, s, "infra_error", 0.0, cost)
        ok = coin("reward", *key) < self.pass_prob(t.domain, t.task_index, s)
        return Attempt(t, s, "ok" if ok else "wrong", 1.0 if ok else 0.0, cost)

    def step(self, step: int, count: int) -> StepLog:
        tickets = self.sched.next_tasks(step, count)
        log = StepLog(list(tickets), [], [], [], collections.Counter())
        pending = tickets
        while pending:
            for d, dom in self.sched.domains.items():
                log.peak_in_flight[d] = max(log.peak_in_flight[d], dom.in_flight)
            attempts = [self.outcome(t, s) for t in pending for s in t.samples]
            log.attempts += attempts
            result = self.sched.report([Outcome(a.ticket.ticket_id, a.sample, a.status, a.reward, a.cost_s)
                                        for a in attempts])
            log.complete += result.complete
            log.dropped += result.dropped
            pending = list(result.retries)
            log.rounds += 1
        self.logs.append(log)
        return log

    def run(self, steps: int, count: int, start: int = 0) -> list[StepLog]:
        return [self.step(s, count) for s in range(start, start + steps)]


def groups_by_domain(tickets) -> collections.Counter:
    return collections.Counter(t.domain for t in tickets)
