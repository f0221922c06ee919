"""One step's draw: the scheduler's tickets run as env episodes, the groups they complete, and the archive row of
every sample attempt (docs/scheduling.md). Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from posttrain.rollout.episodes import Sample
from posttrain.scheduling import archive
from posttrain.scheduling.tickets import STATUSES, Outcome, TaskTicket


@dataclasses.dataclass
class Attempt:
    """One sample run: `ticket`'s sample `sample` (0..G-1), its result and its share of the batch's seconds."""

    ticket: TaskTicket
    sample: int
    result: Sample
    sampler_s: float = 0.0
    env_s: float = 0.0
    in_batch: bool = False

    @property
    def key(self) -> tuple:
        """(group key, sample index, attempt): the one run of one sample."""
        return self.ticket.group_key, self.sample, self.ticket.attempt

    def outcome(self) -> Outcome:
        """The scheduler's Outcome of this run (a status outside `STATUSES`, e.g. "", counts as "ok")."""
        s = self.result
        return Outcome(self.ticket.ticket_id, self.sample, s.status if s.status in STATUSES else "ok", s.reward,
                       env_cost(s.info))


def env_cost(info) -> float:
    """The env-reported sandbox CPU seconds of an episode (`info["cost"]`; 0 when absent)."""
    return float(info.get("cost", 0.0) or 0.0)


# (tickets of one size, samples per ticket, call number) -> (samples, group-major, and the run's perf/* seconds)
RunFn = Callable[[Sequence[TaskTicket], int, int], tuple[list[Sample], dict]]


class StepDraw:
    """One step's draw: groups kept, zero-variance groups set aside, every attempt, perf/* sums and counters."""

    def __init__(self, group_size: int, dynamic_sampling: bool):
        self.G, self.dynamic = group_size, dynamic_sampling
        self.kept: list[list[Attempt]] = []
        self.spare: list[list[Attempt]] = []
        self.attempts: list[Attempt] = []
        self.perf: dict[str, float] = {}
        self.drawn = self.filtered = self.dropped = self.calls = 0

    def run(self, run_fn: RunFn, tickets: Sequence[TaskTicket]) -> list[Attempt]:
        """Runs `tickets`, one `run_fn` call per sample count; returns their Attempts in ticket, then sample order."""
        sizes = list(dict.fromkeys(len(t.samples) for t in tickets))
        out: dict[int, list[Attempt]] = {}
        for size in sizes:
            batch = [t for t in tickets if len(t.samples) == size]
            samples, perf = run_fn(batch, size, self.calls)
            self.calls += 1
            self.perf = {k: self.perf.get(k, 0.0) + v for k, v in perf.items()}
            share = 1.0 / max(len(samples), 1)
            for i, t in enumerate(batch):
                out[t.ticket_id] = [Attempt(t, k, samples[i * size + j], perf.get("perf/gen_s", 0.0) * share,
                                            perf.get("perf/reward_s", 0.0) * share)
                                    for j, k in enumerate(t.samples)]
        attempts = [a for t in tickets for a in out[t.ticket_id]]
        self.attempts += attempts
        return attempts

    def add_group(self, group: list[Attempt]) -> None:
        """Keeps a group of G attempts; with dynamic sampling (DAPO) one of equal scored rewards is set aside."""
        informative = len({a.result.reward for a in group if a.result.counts}) > 1
        (self.kept if informative or not self.dynamic else self.spare).append(group)
        self.filtered += int(self.dynamic and not informative)

    def round(self, run_fn: RunFn, tickets: Sequence[TaskTicket], scheduler, sleep=time.sleep) -> None:
        """Runs one round of tickets and their in-step retries, reporting every sample run to `scheduler`."""
        self.drawn += len(tickets)
        pending, runs = list(tickets), {}
        while pending:
            delay = max(t.delay_s for t in pending)
            if delay > 0:
                sleep(delay)
            attempts = self.run(run_fn, pending)
            runs.update((a.key, a) for a in attempts)
            result = scheduler.report([a.outcome() for a in attempts])
            for g in result.complete:
                self.add_group([runs[(g.group_key, k, g.attempts[k])] for k in range(self.G)])
            self.dropped += len(result.dropped)
            pending = list(result.retries)

    def finish(self, prompts: int, rounds: int) -> tuple[list[Sample], dict, list[Attempt]]:
        """Returns (the batch's samples, metrics, every attempt): the kept groups, topped up with set-aside ones."""
        kept = (self.kept + self.spare)[:prompts]
        for gi, group in enumerate(kept):
            for a in group:
                a.result.group, a.in_batch = gi, True
        perf = dict(self.perf)
        perf["rollout/resample_rounds"] = rounds - 1
        perf["rollout/groups_drawn"] = self.drawn
        perf["rollout/frac_groups_filtered"] = self.filtered / max(self.drawn, 1)  # zero-variance groups set aside
        return [a.result for group in kept for a in group], perf, self.attempts


def archive_rows(attempts: Sequence[Attempt], tokenizer, policy_version: int) -> tuple[dict, ...]:
    """One archive row per attempt, in run order, at `policy_version` unless its tokens carry versions."""
    rows = []
    for a in attempts:
        s = a.result
        details = {"turns": len(s.texts), "probe": a.ticket.probe,
                   **{k: v for k, v in s.info.items() if k not in ("status", "cost")}}
        rows.append(archive.ticket_row(
            a.ticket, a.sample, policy_version=policy_version if s.oldest_version is None else s.oldest_version,
            status=s.status, reward=s.reward,
            prompt_ids=s.prompt_ids, completion_ids=[int(x) for seg, _, _ in s.segments for x in seg],
            prompt=tokenizer.decode(s.prompt_ids, skip_special_tokens=False), completion="\n".join(s.texts),
            truncated=s.truncated,
            in_batch=a.in_batch, sampler_s=a.sampler_s, env_s=a.env_s, env_cost_s=env_cost(s.info),
            details=details))
    return tuple(rows)
