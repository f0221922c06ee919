"""The weighted draw: the scheduler without priorities, quotas or retries: each domain walks its tasks in seeded
passes, and each slot's domain is drawn at the mix weights (docs/scheduling.md)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from posttrain.scheduling.tickets import GroupResult, Outcome, ReportResult, TaskTicket


@dataclasses.dataclass
class DomainCursor:
    epoch: int = 0
    index: int = 0


class WeightedDraw:
    """Draws tasks at their mix weights, behind the `Scheduler` interface; `report` calls every group complete.

    Args:
      sources: {domain name: TaskSource (num_tasks, get_task(i))}.
      weights: {domain name: sampling weight > 0}.
      run: the run's name, the first field of every episode id.
    Raises:
      ValueError: empty sources, unknown/negative weights, or an empty task source.
    """

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, float], *, seed: int = 0,
                 group_size: int = 1, run: str = "run"):
        if not sources:
            raise ValueError("WeightedDraw needs at least one task source")
        if set(weights) != set(sources) or any(w <= 0 for w in weights.values()):
            raise ValueError(f"weights must give a positive weight for each of {sorted(sources)}, got {dict(weights)}")
        for name, src in sources.items():
            if src.num_tasks < 1:
                raise ValueError(f"task source {name!r} is empty")
        self.sources = dict(sources)
        self.names = sorted(sources)
        w = np.asarray([weights[n] for n in self.names], np.float64)
        self.probs = w / w.sum()
        self.seed = seed
        self.cursors = {n: DomainCursor() for n in self.names}
        self._orders: dict[tuple[str, int], np.ndarray] = {}
        self.group_size, self.run = group_size, run
        self._step, self._round, self._issued = -1, 0, 0  # this step's draw rounds and tickets so far
        self._open: dict[int, TaskTicket] = {}

    def _order(self, name: str, epoch: int) -> np.ndarray:
        key = (name, epoch)
        if key not in self._orders:
            n = self.sources[name].num_tasks
            salt = sum(ord(c) * 31 ** i for i, c in enumerate(name)) % (2 ** 31)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != name}  # keep one pass per domain
            self._orders[key] = np.random.default_rng([self.seed, salt, epoch]).permutation(n)
        return self._orders[key]

    def next_tasks(self, step: int, count: int) -> list[TaskTicket]:
        """`count` whole-group tickets for `step`; a step's k-th call draws with key `step * 1000 + k`."""
        if step != self._step:  # a new step: its tickets are numbered anew (a past step's are never reported)
            self._step, self._round, self._issued, self._open = step, 0, 0, {}
        draws = self.next_draws(step * 1000 + self._round, count)
        tickets = [TaskTicket(self._issued + i, step, self.run, d, index, epoch, tuple(range(self.group_size)), 0,
                              task=task) for i, (d, index, epoch, task) in enumerate(draws)]
        self._round, self._issued = self._round + 1, self._issued + len(tickets)
        self._open.update((t.ticket_id, t) for t in tickets)
        return tickets

    def report(self, outcomes: list[Outcome]) -> ReportResult:
        """Every reported ticket's group, complete, in ticket order."""
        rewards: dict[int, dict[int, float]] = {}
        for o in outcomes:
            rewards.setdefault(o.ticket_id, {})[o.sample] = o.reward
        complete = []
        for tid in sorted(rewards):
            t = self._open.pop(tid)
            complete.append(GroupResult(t.domain, t.task_index, t.visit, 0, "complete", (0,) * len(t.samples),
                                        tuple(rewards[tid].get(k, 0.0) for k in t.samples)))
        return ReportResult(complete=tuple(complete))

    def next_draws(self, step: int, count: int) -> list[tuple[str, int, int, dict]]:
        """`count` (domain, task index, pass, task dict) draws for `step`, advancing the cursors."""
        rng = np.random.default_rng([self.seed, 7919, step])
        picks = rng.choice(len(self.names), size=count, p=self.probs)
        out = []
        for i in picks:
            name = self.names[int(i)]
            cur = self.cursors[name]
            index = int(self._order(name, cur.epoch)[cur.index])
            task = self.sources[name].get_task(index)
            out.append((name, index, cur.epoch, task))
            cur.index += 1
            if cur.index >= self.sources[name].num_tasks:
                cur.epoch, cur.index = cur.epoch + 1, 0
        return out

    def set_source(self, name: str, source) -> None:
        """Replaces domain `name`'s task source, keeping its cursor; ValueError for an unknown domain or size."""
        if name not in self.sources:
            raise ValueError(f"unknown domain {name!r}; known {self.names}")
        if source.num_tasks != self.sources[name].num_tasks:
            raise ValueError(f"domain {name!r}: new source has {source.num_tasks} tasks, the old one "
                             f"{self.sources[name].num_tasks}")
        self.sources[name] = source

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New mix weights (one > 0 per domain), e.g. from a learning-progress curriculum."""
        if set(weights) != set(self.names) or any(not w > 0 for w in weights.values()):
            raise ValueError(f"weights must give a positive weight for each of {self.names}, got {dict(weights)}")
        w = np.asarray([weights[n] for n in self.names], np.float64)
        self.probs = w / w.sum()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "cursors": {n: dataclasses.asdict(c) for n, c in self.cursors.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores cursors; ValueError when the saved domains differ from the configured ones."""
        saved = state.get("cursors", {})
        if set(saved) != set(self.names):
            raise ValueError(f"checkpoint task cursors are for domains {sorted(saved)}, config has {self.names}")
        self.cursors = {n: DomainCursor(**saved[n]) for n in self.names}
