"""The schedulers' interface (`Scheduler`) and the job scheduler over hundreds of domains: passive, deterministic,
resumable (docs/scheduling.md)."""
from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from posttrain.scheduling import stats
from posttrain.scheduling.domain_rules import SchedulerSettings, resolve_policies
from posttrain.scheduling.quota import Claim, allocate, share_allowance
from posttrain.scheduling.tickets import (STATUSES, Breaker, GroupResult, OpenGroup, Outcome, ReportResult, Requeued,
                                   TaskTicket)
from posttrain.scheduling.stats import COUNTERS, DomainState

log = logging.getLogger("posttrain.scheduling")
STATE_VERSION = 1


class Scheduler(Protocol):
    """A task scheduler: hands out tickets and decides retries, complete and dropped groups from the outcomes."""

    def next_tasks(self, step: int, count: int) -> list[TaskTicket]: ...

    def report(self, outcomes: list[Outcome]) -> ReportResult: ...

    def set_source(self, name: str, source) -> None: ...

    def set_weights(self, weights: Mapping[str, float]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping) -> None: ...


class JobScheduler:
    """Tickets by domain policy, with retries, quarantine, breaker and pass-rate stats.

    Args:
      sources: {domain: TaskSource (num_tasks, get_task(i))}.
      weights: {domain: mix weight > 0} (default 1), times the policy's weight.
    Raises:
      ValueError: no or empty sources, bad weights, or policies that do not resolve.
    """

    def __init__(self, sources: Mapping[str, Any], settings: SchedulerSettings,
                 weights: Mapping[str, float] | None = None):
        if not sources or any(s.num_tasks < 1 for s in sources.values()):
            raise ValueError(f"JobScheduler needs non-empty task sources, got "
                             f"{ {n: s.num_tasks for n, s in sources.items()} }")
        self.settings, self.names = settings, sorted(sources)
        policies = resolve_policies(self.names, settings.policies)
        s = settings
        self.domains = {n: DomainState(sources[n], policies[n], 1.0,
                                       Breaker(s.breaker_window, s.breaker_rate, s.breaker_cooldown_steps))
                        for n in self.names}
        self.set_weights(weights or dict.fromkeys(self.names, 1.0))
        self.step, self.next_ticket = -1, 0
        self._tickets: dict[int, TaskTicket] = {}
        self._unreported: dict[int, set] = {}
        self._groups: dict[tuple, OpenGroup] = {}
        self._orders: dict[str, tuple[int, np.ndarray]] = {}

    # ---- sources and weights (the curriculum's hooks, as WeightedDraw's) ----
    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New mix weights (one > 0 per domain), e.g. from a learning-progress curriculum."""
        if set(weights) != set(self.names) or any(not w > 0 for w in weights.values()):
            raise ValueError(f"weights must give a positive weight for each of {self.names}, got {dict(weights)}")
        for n in self.names:
            self.domains[n].weight = float(weights[n])

    def set_source(self, name: str, source) -> None:
        """Replaces `name`'s task source, keeping its cursor (band statistics restart).

        Raises ValueError for an unknown domain or a source of another size."""
        if name not in self.domains:
            raise ValueError(f"unknown domain {name!r}; known {self.names}")
        dom = self.domains[name]
        if source.num_tasks != dom.source.num_tasks:
            raise ValueError(f"domain {name!r}: new source has {source.num_tasks} tasks, the old one "
                             f"{dom.source.num_tasks}")
        dom.source = source
        stats.reset(dom.tasks)

    # ---- drawing ----
    def next_tasks(self, step: int, count: int) -> list[TaskTicket]:
        """Tickets of `count` groups for `step` (fewer when caps bind), by `quota.allocate`; advances the state."""
        if count < 0:
            raise ValueError(f"next_tasks: count must be >= 0, got {count}")
        if step != self.step:
            for dom in self.domains.values():
                dom.last = dict.fromkeys(COUNTERS, 0)
            self.step = step
        claims, carries, probes = {}, {}, set()
        for name in self.names:
            claim = self._claim(name, step, count)
            if claim is not None:
                claims[name], carries[name], probe = claim
                if probe:
                    probes.add(name)
        counts, credits, _ = allocate({n: c for n, c in claims.items()}, count, self.settings.max_credit)
        tickets = []
        for name in sorted(claims):
            dom = self.domains[name]
            dom.credit, dom.share_carry = credits[name], carries[name]
            dom.count("slots", count)
            for _ in range(counts[name]):
                ticket = self._issue(name, step, probe=name in probes)
                if ticket is None:
                    break
                tickets.append(ticket)
        return tickets

    def _claim(self, name: str, step: int, count: int) -> tuple[Claim, float, bool] | None:
        """(this call's Claim, the share carry after it, whether it is a probe), or None: not a candidate."""
        dom, G = self.domains[name], self.settings.group_size
        probe = dom.breaker.probe_due(step)
        if dom.breaker.state != "closed" and not probe:
            return None
        drawable = self._drawable(dom, step)
        if drawable == 0:
            return None
        p = dom.policy
        share_cap, carry = share_allowance(p.max_share, count, dom.share_carry)
        cpu_hard = count
        if p.max_env_cpu_s > 0 and (dom.cost is None or dom.cost > 0):  # unknown cost: one group measures it
            cpu_hard = 1 if dom.cost is None else int(math.floor(p.max_env_cpu_s / (G * dom.cost) + 1e-9))
        conc = count if not p.max_concurrency else max(0, (p.max_concurrency - dom.in_flight) // G)
        hard = min(share_cap, cpu_hard, conc, count, drawable)
        rate = min(p.max_share * count, cpu_hard, conc, drawable)  # feasible: only the share is fractional
        if probe:
            hard, rate = min(hard, 1), min(rate, 1.0)
        claim = Claim(weight=dom.weight * p.weight, priority=p.priority, min_rate=p.min_share * count,
                      rate_cap=rate, hard_cap=hard, credit=dom.credit)
        return claim, carry, probe

    def _drawable(self, dom: DomainState, step: int) -> int | float:
        ready = sum(1 for r in dom.requeue if r.ready_step <= step and r.task_index not in dom.quarantine)
        return ready if len(dom.quarantine) >= dom.source.num_tasks else math.inf

    def _order(self, name: str, epoch: int) -> np.ndarray:
        cached = self._orders.get(name)
        if cached is None or cached[0] != epoch:
            salt = zlib.crc32(name.encode())
            perm = np.random.default_rng([self.settings.seed, salt, epoch]).permutation(
                self.domains[name].source.num_tasks)
            self._orders[name] = cached = (epoch, perm)
        return cached[1]

    def _fresh(self, name: str, step: int) -> int | None:
        """The next task index of `name`'s pass order neither quarantined nor skipped; None if all are quarantined."""
        dom = self.domains[name]
        n, skips = dom.source.num_tasks, 0
        for _ in range(2 * n + 1):
            epoch, index = dom.epoch, int(self._order(name, dom.epoch)[dom.index])
            dom.index += 1
            if dom.index >= n:
                dom.epoch, dom.index = dom.epoch + 1, 0
            if index in dom.quarantine:
                continue
            if skips < n and stats.should_skip(dom.tasks.get(index), self.settings, step, name, index, epoch):
                skips += 1
                dom.count("skipped")
                continue
            dom.count("fresh")
            return index
        return None

    def _issue(self, name: str, step: int, probe: bool) -> TaskTicket | None:
        dom, G = self.domains[name], self.settings.group_size
        ready = sorted((r for r in dom.requeue if r.ready_step <= step and r.task_index not in dom.quarantine),
                       key=lambda r: (r.ready_step, r.task_index, r.visit))
        if ready:
            r = ready[0]
            dom.requeue.remove(r)
            index, visit, try_index, attempt = r.task_index, r.visit, r.try_index, r.attempt
        else:
            index = self._fresh(name, step)
            if index is None:
                return None
            entry = dom.tasks.setdefault(index, stats.new_entry())
            visit, try_index, attempt = entry[stats.DRAWS], 0, 0
            entry[stats.DRAWS] += 1
        ticket = TaskTicket(self.next_ticket, step, self.settings.run, name, index, visit, tuple(range(G)), attempt,
                            try_index, probe=probe, task=dom.source.get_task(index))
        self.next_ticket += 1
        self._groups[ticket.group_key] = OpenGroup(name, index, visit, try_index, step, attempt + 1, probe,
                                                   pending=dict.fromkeys(range(G), ticket.ticket_id))
        self._track(ticket)
        dom.count("groups")
        if probe:
            dom.breaker.state = "probing"
        return ticket

    def _track(self, ticket: TaskTicket) -> None:
        self._tickets[ticket.ticket_id] = ticket
        self._unreported[ticket.ticket_id] = set(ticket.samples)
        self.domains[ticket.domain].in_flight += len(ticket.samples)

    # ---- reporting ----
    def report(self, outcomes: Sequence[Outcome]) -> ReportResult:
        """Takes one Outcome per sample run; decides retries, complete and dropped groups once none is in flight.

        Raises ValueError for an unknown ticket or status, a sample not on its ticket, or a second outcome for a run."""
        touched: dict[tuple, None] = {}
        for o in outcomes:
            ticket = self._take(o)
            dom = self.domains[ticket.domain]
            dom.in_flight -= 1
            dom.cost = o.cost_s if dom.cost is None else dom.cost + self.settings.cost_ema * (o.cost_s - dom.cost)
            dom.count("episodes")
            dom.count("cpu_s", o.cost_s)
            dom.count("infra_errors", int(o.infra))
            dom.breaker.record(o.infra)
            g = self._groups.get(ticket.group_key)
            if g is None or g.pending.get(o.sample) != ticket.ticket_id:
                continue  # its group was decided already
            del g.pending[o.sample]
            if o.infra:
                g.failed[o.sample] = ticket.retry_round
            else:
                g.scored[o.sample] = (ticket.attempt, float(o.reward))
                g.failed.pop(o.sample, None)
            touched[ticket.group_key] = None
        for name in sorted({k[0] for k in touched}):
            if self.domains[name].breaker.should_trip():
                self.domains[name].breaker.trip(self.step)
                log.warning("tasks: domain %s paused: infra-error rate over its last %d sample attempts is above "
                            "%.2f; a probe group runs after %d steps", name, self.settings.breaker_window,
                            self.settings.breaker_rate, self.settings.breaker_cooldown_steps)
        retries, complete, dropped = [], [], []
        for key in touched:
            g = self._groups[key]
            if g.pending:
                continue
            if len(g.scored) == self.settings.group_size:
                complete.append(self._complete(g))
            elif self._retryable(g):
                retries.append(self._retry(g))
            else:
                dropped.append(self._drop(g))
        return ReportResult(tuple(retries), tuple(complete), tuple(dropped))

    def _take(self, o: Outcome) -> TaskTicket:
        ticket = self._tickets.get(o.ticket_id)
        if ticket is None:
            raise ValueError(f"report: unknown ticket {o.ticket_id} (or all its samples were reported)")
        left = self._unreported[o.ticket_id]
        if o.sample not in left:
            raise ValueError(f"report: sample {o.sample} of ticket {o.ticket_id} is not on it or was reported; "
                             f"open samples {sorted(left)}")
        if o.status not in STATUSES:
            raise ValueError(f"report: status {o.status!r} of ticket {o.ticket_id}; expected one of {STATUSES}")
        left.remove(o.sample)
        if not left:
            del self._tickets[o.ticket_id], self._unreported[o.ticket_id]
        return ticket

    def _retryable(self, g: OpenGroup) -> bool:
        return (not g.probe and self.domains[g.domain].breaker.state == "closed"
                and max(g.failed.values()) < self.settings.retries_per_step)

    def _retry(self, g: OpenGroup) -> TaskTicket:
        rnd = max(g.failed.values()) + 1
        samples = tuple(sorted(g.failed))
        ticket = TaskTicket(self.next_ticket, g.step, self.settings.run, g.domain, g.task_index, g.visit, samples,
                            g.next_attempt, g.try_index, rnd, self.settings.backoff(rnd),
                            task=self.domains[g.domain].source.get_task(g.task_index))
        self.next_ticket += 1
        g.next_attempt += 1
        g.pending, g.failed = dict.fromkeys(samples, ticket.ticket_id), {}
        self._track(ticket)
        self.domains[g.domain].count("retries", len(samples))
        return ticket

    def _complete(self, g: OpenGroup) -> GroupResult:
        dom, thr = self.domains[g.domain], self.settings.pass_threshold
        result = g.result("complete", self.settings.group_size)
        stats.record_visit(dom.tasks.setdefault(g.task_index, stats.new_entry()), result.rewards, g.step, thr)
        dom.count("complete")
        dom.count("scored", len(result.rewards))
        dom.count("passes", sum(r >= thr for r in result.rewards))
        if g.probe:
            dom.breaker.probe_result(True, self.step)
        del self._groups[g.group_key]
        return result

    def _drop(self, g: OpenGroup) -> GroupResult:
        """Drops the group: re-queued with its next try, or its task quarantined after its last allowed try."""
        dom = self.domains[g.domain]
        tries = g.try_index + (0 if g.probe else 1)
        if g.probe:
            dom.breaker.probe_result(False, self.step)
        del self._groups[g.group_key]
        dom.count("dropped")
        if tries >= self.settings.max_attempts:
            dom.quarantine.add(g.task_index)
            return g.result("quarantined", self.settings.group_size)
        dom.requeue.append(Requeued(g.task_index, g.visit, tries, g.next_attempt, g.step + 1))
        return g.result("requeued", self.settings.group_size)

    # ---- views ----
    def quarantined(self) -> dict[str, list[int]]:
        """{domain: sorted quarantined task indices} (domains with none left out)."""
        return {n: sorted(d.quarantine) for n, d in self.domains.items() if d.quarantine}

    def paused(self) -> list[str]:
        """Domains whose breaker is open or probing."""
        return [n for n, d in self.domains.items() if d.breaker.state != "closed"]

    def in_flight(self) -> int:
        """Samples handed out and not yet reported."""
        return sum(d.in_flight for d in self.domains.values())

    def metrics(self) -> dict[str, float]:
        """`tasks/<domain>/*` and `tasks/{skipped_frac,retries,dropped_groups,quarantined,paused}` of the last step."""
        out, doms = {}, self.domains.values()
        for name, dom in self.domains.items():
            out.update(dom.metrics(f"tasks/{name}"))
        skipped, fresh = sum(d.last["skipped"] for d in doms), sum(d.last["fresh"] for d in doms)
        out.update({"tasks/skipped_frac": skipped / (skipped + fresh) if skipped + fresh else 0.0,
                    "tasks/retries": float(sum(d.last["retries"] for d in doms)),
                    "tasks/dropped_groups": float(sum(d.last["dropped"] for d in doms)),
                    "tasks/quarantined": float(sum(len(d.quarantine) for d in doms)),
                    "tasks/paused": float(len(self.paused()))})
        return out

    def summary(self) -> dict:
        """{domain: its run view} (`stats.DomainState.summary`), JSON-able (status.json)."""
        return {name: dom.summary() for name, dom in self.domains.items()}

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """The whole state, JSON-able; ValueError while samples are in flight (save between steps)."""
        if self._tickets:
            raise ValueError(f"scheduler state_dict with {self.in_flight()} samples of {len(self._tickets)} tickets in "
                             "flight: report them first (checkpoints are saved between steps)")
        return {"version": STATE_VERSION, "seed": self.settings.seed, "step": self.step,
                "next_ticket": self.next_ticket, "domains": {n: d.state_dict() for n, d in self.domains.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores `state_dict()` exactly. Raises ValueError for another version, seed or set of domains."""
        if state.get("version") != STATE_VERSION or state.get("seed") != self.settings.seed:
            raise ValueError(f"checkpoint scheduler state version/seed {state.get('version')}/{state.get('seed')}; "
                             f"this scheduler has {STATE_VERSION}/{self.settings.seed}")
        saved = state.get("domains", {})
        if set(saved) != set(self.names):
            raise ValueError(f"checkpoint scheduler state is for domains {sorted(saved)}, config has {self.names}")
        for n in self.names:
            self.domains[n].load_state_dict(saved[n])
        self.step, self.next_ticket = int(state["step"]), int(state["next_ticket"])
        self._tickets, self._unreported, self._groups = {}, {}, {}
