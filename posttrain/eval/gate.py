"""The evaluation gate's decisions (pure, no JAX or I/O): regressed domains, pass / warn / stop, the best checkpoint.

Shapes: the legend in `posttrain.types`. The loop side: `posttrain.eval.gate_hook`; the rules: docs/evaluation.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence




ACTIONS = ("warn", "stop")  # what a regression beyond max_drop does


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateConfig:
    """The `eval.gate` section: what a regression found by the in-loop suite (`eval.suite`) does.

    Attributes:
        action: "warn" logs the regression and trains on; "stop" ends the run at that step (checkpoint saved).
        max_drop: the pass@1 drop, a share of tasks in [0, 1), a "regressed" verdict must exceed (0: any).
        alpha: family-wise level of the verdicts across the suite's domains (Holm), in (0, 1).
    """

    action: str = "warn"
    max_drop: float = 0.0
    alpha: float = 0.05

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"gate.action={self.action!r}; expected one of {ACTIONS}")
        if not (isinstance(self.max_drop, (int, float)) and 0.0 <= self.max_drop < 1.0):
            raise ValueError(f"gate.max_drop={self.max_drop!r} is out of range: must be in [0, 1)")
        if not (isinstance(self.alpha, (int, float)) and 0.0 < self.alpha < 1.0):
            raise ValueError(f"gate.alpha={self.alpha!r} is out of range: must be in (0, 1)")




@dataclasses.dataclass(frozen=True, kw_only=True)
class GateSettings:
    """The in-loop suite and its gate (`posttrain.config.plan` builds it from the `eval` section).

    Attributes:
        suite: the parsed suite (`posttrain.eval.suite.Suite`).
        gate_config: what a regression does (the `eval.gate` section).
        every_steps: run the suite after every this many completed steps (>= 1).
    """

    suite: Any
    gate_config: GateConfig
    every_steps: int

    def due(self, step: int) -> bool:
        """Whether the suite runs after `step` completed steps (step 0, the baseline, is sampled at the start)."""
        return step > 0 and step % self.every_steps == 0


@dataclasses.dataclass(frozen=True)
class DomainRow:
    """One domain of a comparison: its pass@1 verdict, baseline and candidate pass@1 (shares of tasks), tasks."""

    domain: str
    verdict: str
    baseline: float
    candidate: float
    tasks: int = 1


@dataclasses.dataclass(frozen=True)
class GateDecision:
    """The decision at one step: regressed {domain: drop}, improved domains, action, `trained_score`, best so far."""

    step: int
    regressed: Mapping[str, float]
    improved: tuple[str, ...]
    action: str
    score: float
    best_step: int
    best_score: float
    new_best: bool

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "regressed": dict(self.regressed), "improved": list(self.improved)}


def regressions(rows: Sequence[DomainRow], max_drop: float) -> dict[str, float]:
    """{domain: pass@1 drop} of the "regressed" rows dropping more than `max_drop`; ValueError for bad input."""
    if not 0.0 <= max_drop < 1.0:
        raise ValueError(f"max_drop must be in [0, 1), got {max_drop}")
    out = {}
    for r in rows:
        if r.verdict not in ("improved", "no change", "regressed"):
            raise ValueError(f"domain {r.domain!r}: unknown verdict {r.verdict!r}")
        drop = r.baseline - r.candidate
        if r.verdict == "regressed" and drop > max_drop:
            out[r.domain] = drop
    return out


def trained_score(rows: Sequence[DomainRow], trained: Sequence[str]) -> float:
    """The task-weighted mean candidate pass@1 of the `trained` domains (all rows if none); ValueError for no rows."""
    if not rows:
        raise ValueError("trained_score of no domains")
    picked = [r for r in rows if r.domain in set(trained)] or list(rows)
    tasks = sum(r.tasks for r in picked)
    return sum(r.candidate * r.tasks for r in picked) / tasks


def decide(rows: Sequence[DomainRow], *, step: int, action: str, max_drop: float, trained: Sequence[str],
           best: tuple[int, float] | None = None) -> GateDecision:
    """The decision at `step` given the previous best (step, score) or None; ValueError for an unknown action."""
    if action not in ACTIONS:
        raise ValueError(f"gate action must be one of {ACTIONS}, got {action!r}")
    regressed = regressions(rows, max_drop)
    score = trained_score(rows, trained)
    new_best = best is None or score >= best[1]
    best_step, best_score = (step, score) if new_best else best
    return GateDecision(step, regressed, tuple(r.domain for r in rows if r.verdict == "improved"),
                        action if regressed else "pass", score, best_step, best_score, new_best)


def gate_metrics(decision: GateDecision, rows: Sequence[DomainRow]) -> dict[str, float]:
    """The eval/gate/* metrics of a decision, with eval/gate/<domain>/pass@1 and .../diff per domain."""
    out = {"eval/gate/regressed": float(len(decision.regressed)), "eval/gate/improved": float(len(decision.improved)),
           "eval/gate/warn": float(decision.action == "warn"), "eval/gate/stop": float(decision.action == "stop"),
           "eval/gate/score": decision.score, "eval/gate/best_score": decision.best_score,
           "eval/gate/best_step": float(decision.best_step)}
    for r in rows:
        out[f"eval/gate/{r.domain}/pass@1"] = r.candidate
        out[f"eval/gate/{r.domain}/diff"] = r.candidate - r.baseline
    return out


def rows_of(comparison) -> list[DomainRow]:
    """The DomainRows of a `posttrain.eval.compare.Comparison` (pass@1 verdicts and means)."""
    return [DomainRow(d.domain, d.verdict, d.pass_at_1.baseline, d.pass_at_1.candidate, d.tasks)
            for d in comparison.domains]


def message(decision: GateDecision, table: str) -> str:
    """The warning / stop line of a decision: the step, each regressed domain and its drop, where the table is."""
    listed = ", ".join(f"{d} (pass@1 -{drop:.3f})" for d, drop in decision.regressed.items())
    verb = "stopping the run" if decision.action == "stop" else "training on (eval.gate.action=warn)"
    return f"eval gate at step {decision.step}: regressed against the initial policy: {listed}; {verb}; table: {table}"


