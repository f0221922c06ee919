"""The `eval` section of a run's config: held-out evaluation on `env.eval` and the evaluation gate of the training
loop (`eval.suite`, `eval.gate`; `posttrain.eval.gate` decides, `posttrain.eval.gate_hook` runs it)."""
from __future__ import annotations

import dataclasses

GATE_ACTIONS = ("warn", "stop")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateConfig:
    """The `eval.gate` section: what a regression found by the in-loop suite (`eval.suite`) does.

    Attributes:
        action: "warn" logs the regression and trains on; "stop" ends the run at that step (checkpoint saved,
            comparison table written under the run's workdir, summary.json saying why).
        max_drop: a domain counts as regressed only when its verdict is "regressed" (exact McNemar, Holm-adjusted
            at `alpha`) and its pass@1 fell by more than this (a share of tasks in [0, 1); 0: any significant drop).
        alpha: family-wise level of the verdicts across the suite's domains (Holm), in (0, 1).
    """

    action: str = "warn"
    max_drop: float = 0.0
    alpha: float = 0.05

    def __post_init__(self):
        if self.action not in GATE_ACTIONS:
            raise ValueError(f"gate.action={self.action!r}; expected one of {GATE_ACTIONS}")
        if not (isinstance(self.max_drop, (int, float)) and 0.0 <= self.max_drop < 1.0):
            raise ValueError(f"gate.max_drop={self.max_drop!r} is out of range: must be in [0, 1)")
        if not (isinstance(self.alpha, (int, float)) and 0.0 < self.alpha < 1.0):
            raise ValueError(f"gate.alpha={self.alpha!r} is out of range: must be in (0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The `eval` section: held-out evaluation on `env.eval`, and the evaluation gate.

    Attributes:
        every_steps: evaluate every this many steps during training (0: never); with `suite`, the suite and its
            gate run at the same steps (then >= 1).
        at_start: evaluate before the first step.
        at_end: evaluate after the last step.
        num_tasks: the first this many tasks of each domain.
        max_new_tokens: completion tokens per eval turn.
        temperature: eval sampling temperature (0: greedy).
        batch_size: episodes per sampler call.
        scorer: "env" uses the env's reward (>= 1 solves); "last_integer" compares the last integer of the reply
            with the task's answer.
        seed: the evaluation sampling stream (`jax.random.key(seed)`, folded per domain and batch), for the
            loop's evaluations and `posttrain eval --suite`; two evaluations with different seeds draw independent
            samples (-1: train.seed + 1).
        suite: a `configs/eval/*.py` suite file run during training every `every_steps` steps on the current
            policy against the run's initial policy (its records sampled once, at step 0, and kept in
            workdir/eval_gate/baseline); "" (default): no gate.
        gate: what a regression on the suite does (GateConfig).
    """

    every_steps: int = 0
    at_start: bool = True
    at_end: bool = True
    num_tasks: int = 200
    max_new_tokens: int = 24
    temperature: float = 0.0
    batch_size: int = 64
    scorer: str = "env"
    seed: int = -1
    suite: str = ""
    gate: GateConfig = GateConfig()
