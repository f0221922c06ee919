"""The reward-model recipe (`posttrain rm`): a backbone with a new scalar head (`model.reward_head`) on DPO's pairs.

Held-out accuracy beside a length-only baseline; exported as a transformers classifier (docs/commands.md)."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Mapping

import jax
import numpy as np
from flax import nnx

from posttrain.algos.dpo import data as data_lib
from posttrain.algos.rm import step as rm_step
from posttrain.algos.sft.packing import step_rows
from posttrain.checkpoints.policy import PolicySource, load_policy
from posttrain.checkpoints.reward_model import RUN_SUBDIR, export_reward_model
from posttrain.config.rm import RMRunConfig, to_dict
from posttrain.infra import distributed, mesh as mesh_lib
from posttrain.infra.partitioning import use_rules
from posttrain.infra.precision import PrecisionPolicy
from posttrain.learn.learner import Learner, LearnerSettings
from posttrain.learn.state import merge_model
from posttrain.model.reward_head import with_head
from posttrain.recipes import dpo as dpo_recipe
from posttrain.learn import offline_loop
from posttrain.config.plan import offline_layout
from posttrain.learn.learner import TrainConfig
from posttrain.runs import workdir as workdir_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMPlan:
    """Every derived setting of one reward-model run.

    Attributes:
      workdir: the run's directory.
      config_dict: the config as a plain dict (config.json, checkpoint metadata); code reads the other fields.
      precision: the resolved precision policy.
      mesh_shape: resolved mesh axis sizes (no -1).
      rules: logical-axis rules with the config's overlays.
      policy: where the backbone comes from.
      data: the pair data settings (DPO's).
      step: the reward-model step's static options.
      learner: the update phase's settings.
      train: steps and limits.
      eval_at_start: held-out metrics before the first step.
      eval_at_end: held-out metrics after the last step.
      export: write `<workdir>/reward_model` at the end."""

    workdir: pathlib.Path
    config_dict: dict
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]
    rules: tuple
    policy: PolicySource
    data: data_lib.PairSettings
    step: rm_step.StepOptions
    learner: LearnerSettings
    train: TrainConfig
    eval_at_start: bool = True
    eval_at_end: bool = True
    export: bool = True


def make_rm_plan(cfg: RMRunConfig, *, num_devices: int | None = None, workdir: str | None = None,
                 backend: str | None = None) -> RMPlan:
    """Derives and validates every setting of a reward-model run (no I/O); ConfigError as `offline_layout`."""
    r, t = cfg.rm, cfg.train
    shape, rules, _, precision = offline_layout(cfg, "rm.pairs_per_step", r.pairs_per_step, r.num_microbatches,
                                                num_devices, backend)
    wd = pathlib.Path(workdir or t.workdir)
    config_dict = to_dict(cfg)
    pairs = dpo_recipe.pair_settings(r, t.seed)
    step = rm_step.StepOptions(loss=r.loss, center_coef=float(r.center_coef), num_microbatches=r.num_microbatches,
                               matmul_precision=cfg.model.matmul_precision)
    learner = LearnerSettings(workdir=wd, optimizer=cfg.optim, total_steps=cfg.train.steps, seed=t.seed, checkpointing=cfg.checkpoint,
                              rules=rules, config_dict=config_dict)
    return RMPlan(workdir=wd, config_dict=config_dict, precision=precision, mesh_shape=shape, rules=rules,
                  policy=PolicySource.of(cfg.model, cfg.lora, precision, seed=cfg.train.seed), data=pairs, step=step, learner=learner,
                  train=cfg.train,
                  eval_at_start=r.eval_at_start, eval_at_end=r.eval_at_end, export=r.export)


def length_accuracy(pairs, direction: int = 1) -> np.ndarray:
    """The length baseline's accuracy [P]: 1 if the chosen reply is longer (at -1: shorter), 1/2 if tied."""
    d = direction * np.asarray([len(p.chosen) - len(p.rejected) for p in pairs], np.int64)
    return np.where(d > 0, 1.0, np.where(d == 0, 0.5, 0.0))


def length_direction(pairs) -> int:
    """+1 (the longer reply wins) or -1: the length baseline's more accurate direction on `pairs` (+1 on a tie)."""
    return 1 if not pairs or length_accuracy(pairs, 1).mean() >= 0.5 else -1


def held_out_metrics(acc_P: np.ndarray, margin_P: np.ndarray, length_P: np.ndarray,
                     direction: int = 1) -> dict[str, float]:
    """The held-out rm/* metrics (docs/commands.md) from per-pair accuracies, margins and length-baseline accuracies."""
    lo, hi = offline_loop.bootstrap_interval(acc_P)
    dlo, dhi = offline_loop.paired_difference_interval(acc_P, length_P)
    return {"rm/accuracy": float(acc_P.mean()), "rm/accuracy_lo": lo, "rm/accuracy_hi": hi,
            "rm/margin": float(margin_P.mean()), "rm/pairs": float(len(acc_P)),
            "rm/length_baseline_accuracy": float(length_P.mean()), "rm/length_baseline_direction": float(direction),
            "rm/vs_length": float(acc_P.mean() - length_P.mean()), "rm/vs_length_lo": dlo, "rm/vs_length_hi": dhi}


class Run:
    """The pieces of a reward-model run (backbone with its head, pairs, restored learner); claims the workdir first."""

    def __init__(self, plan: RMPlan):
        workdir_lib.claim_offline(plan.workdir, "rm", plan.config_dict, RMRunConfig)
        self.plan = plan
        self.mesh = mesh_lib.make_mesh(plan.mesh_shape)
        self.model_config, graphdef, weights, self.tokenizer = load_policy(plan.policy, self.mesh, plan.rules)
        graphdef, weights = with_head(self.model_config, graphdef, weights, self.mesh, plan.rules,
                                      seed=plan.learner.seed)
        self.train_pairs, self.eval_pairs = dpo_recipe.load_pairs(plan.data, self.tokenizer, "rm")
        self.regions = data_lib.regions(self.train_pairs + self.eval_pairs)
        build = lambda g, tx, lr, mc: rm_step.make_train_step(g, tx, lr, plan.step)
        self.learner = Learner.create(plan.learner, self.mesh, self.model_config, graphdef, weights, build,
                                      batch_type=rm_step.RewardBatch)
        self.learner.restore()
        workdir_lib.write_config(plan.workdir, plan.config_dict)  # restored (or new): its settings
        self._eval_fn = rm_step.make_eval_fn(self.learner.graphdef, plan.step)
        self.counts = {"rm/train_pairs": len(self.train_pairs), "rm/eval_pairs": len(self.eval_pairs),
                       "rm/truncated": sum(p.truncated for p in self.train_pairs + self.eval_pairs)}

    def batch(self, step: int) -> rm_step.RewardBatch:
        """The host batch of `step`: pairs drawn epoch by epoch in a seeded order (a function of the step)."""
        d = self.plan.data
        chunk = [self.train_pairs[i] for i in step_rows(len(self.train_pairs), d.pairs_per_step, step, d.seed)]
        return data_lib.make_batch(chunk, *self.regions, self.tokenizer.pad_id, d.pairs_per_step)

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics of the current weights ({} without held-out pairs)."""
        if not self.eval_pairs:
            return {}
        acc, margin, P, state = [], [], self.plan.data.pairs_per_step, self.learner.state
        for i in range(0, len(self.eval_pairs), P):
            batch = data_lib.make_batch(self.eval_pairs[i:i + P], *self.regions, self.tokenizer.pad_id, P)
            with jax.set_mesh(self.mesh):
                terms, valid = self._eval_fn(state.params, state.frozen,
                                             offline_loop.place(batch, self.mesh, self.plan.rules))
            terms, valid = jax.device_get((terms, valid))
            acc.extend(np.asarray(terms["rm/train_accuracy"])[valid])
            margin.extend(np.asarray(terms["rm/train_margin"])[valid])
        direction = length_direction(self.train_pairs)
        return held_out_metrics(np.asarray(acc), np.asarray(margin), length_accuracy(self.eval_pairs, direction),
                                direction)

    def tokens(self, batch) -> int:
        return int(np.count_nonzero(batch.segment_ids_RxL))

    def export(self) -> pathlib.Path:
        """Writes the current weights to `<workdir>/reward_model` (`checkpoints.reward_model`)."""
        s = self.learner.state
        model = merge_model(self.learner.graphdef, s.params, s.frozen)
        return export_reward_model(self.model_config, nnx.state(model), self.plan.workdir / RUN_SUBDIR,
                                   tokenizer=self.tokenizer)


def train(plan: RMPlan, *, progress: bool = True) -> dict:
    """Runs (or resumes) reward-model training as planned, then exports it (`plan.export`); returns the summary.

    Raises ValueError / TypeError for unusable pairs (naming the record), NonFiniteError as `grpo.train` does."""
    # a signal while the run is built is one line too; its grace is the config's
    with use_rules(plan.rules), distributed.StopRequest(plan.learner.checkpointing.stop_grace_s) as stop:
        run = Run(plan)
        summary = offline_loop.train_loop(run, name="rm", workdir=plan.workdir, train_config=plan.train,
                                     config_dict=plan.config_dict, eval_at_start=plan.eval_at_start,
                                     eval_at_end=plan.eval_at_end, progress=progress, stop=stop,
                                     bar_fields=(("loss", "rm/loss"), ("acc", "rm/train_accuracy")),
                                     on_nonfinite=lambda: "; lower optim.lr")
        if plan.export:
            summary["export"] = str(run.export())
            (plan.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
