"""The training loop, the only imperative driver: plan -> rollouter / learner -> for each step: collect, train, log,
save, evaluate. No math and no derived settings live here (those are `posttrain.recipes.run_plan.RunPlan`'s).

Outputs in the workdir: `metrics.jsonl`, TensorBoard events, `reward_curve.png`, `trajectories/step_*.jsonl`
(prompts, replies, rewards), `eval/step_*.jsonl`, `checkpoints/` (Orbax), `summary.json`. Re-running the same
command resumes from the last complete checkpoint with the same task order and RNG stream.
"""
from __future__ import annotations

import json
import time

from posttrain.infra import distributed, metrics as metrics_lib

from posttrain.checkpoints import policy as setup
from posttrain.infra import mesh as mesh_lib
from posttrain.config import Config, to_dict
from posttrain.learn.learner import Learner
from posttrain.infra.partitioning import use_rules
from posttrain.rollout.rollouter import Rollouter, write_jsonl
from posttrain.recipes.run_plan import RunPlan, make_run_plan


class NonFiniteError(RuntimeError):
    """Training stopped after `train.max_nonfinite_skips` consecutive steps with a non-finite loss or gradient."""


def build(plan: RunPlan) -> tuple[Rollouter, Learner]:
    """The two phases of a run: the policy loaded on the plan's mesh, the learner's train state (restored from the
    newest checkpoint in the workdir, if any) and the rollouter (its scheduler and curriculum restored with it).
    Writes the workdir's config.json."""
    plan.workdir.mkdir(parents=True, exist_ok=True)
    (plan.workdir / "config.json").write_text(json.dumps(to_dict(plan.cfg), indent=2, default=str))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    model_config, graphdef, weights, tokenizer = setup.load_policy(plan.cfg, mesh, plan.precision, plan.rules)
    learner = Learner.create(plan, mesh, model_config, graphdef, weights)
    rollouter = Rollouter.create(plan, mesh, learner.graphdef, tokenizer, meta=learner.restore())
    return rollouter, learner


def evaluate(rollouter: Rollouter, learner: Learner) -> dict:
    """eval/* metrics of the learner's current policy; process 0 writes the records to eval/step_*.jsonl."""
    m, records = rollouter.evaluate(learner.policy())
    if distributed.is_main_process():
        write_jsonl(learner.plan.workdir / "eval" / f"step_{learner.step:06d}.jsonl", records)
    return m


def train(cfg: Config | RunPlan, *, workdir: str | None = None, progress: bool = True) -> dict:
    """Runs (or resumes) GRPO training as configured; returns the summary dict (also in summary.json).

    Raises ConfigError (before any work) for a config that makes no valid run plan, and NonFiniteError (after
    saving a checkpoint) when `train.max_nonfinite_skips` consecutive steps had a non-finite loss or gradient."""
    plan = cfg if isinstance(cfg, RunPlan) else make_run_plan(cfg, workdir=workdir)
    with use_rules(plan.rules):  # the activation sharding constraints traced by the sampler and the train step
        return _train(plan, progress)


def _train(plan: RunPlan, progress: bool) -> dict:
    for warning in plan.warnings:
        metrics_lib.log.warning(warning)
    rollouter, learner = build(plan)
    cfg, start = plan.cfg, learner.step
    main = distributed.is_main_process()  # process 0 writes metrics, plots, trajectories and the summary
    writer = metrics_lib.MetricsWriter(plan.workdir, resume_step=start if start else None) if main else None
    bar = metrics_lib.ProgressBar(cfg.train.steps, initial_step=start, disable=not (progress and main))
    summary = {"start_step": start, "config": to_dict(cfg)}
    if start == 0 and cfg.eval.at_start and rollouter.eval_episodes:
        summary["eval_start"] = m = evaluate(rollouter, learner)
        if writer:
            writer.write(0, m)
    clock = metrics_lib.TrainClock()  # training wall time: rollouts, updates, checkpoints; not in-loop evaluation
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        traj = rollouter.collect(step, learner.policy(), learner.rng)
        t1 = time.perf_counter()
        m = learner.update(traj.batch)
        t2 = time.perf_counter()
        m.update(traj.metrics)
        m.update(metrics_lib.step_perf(traj.num_tokens, t0, t1, t2))
        if main:
            write_jsonl(plan.workdir / "trajectories" / f"step_{step:06d}.jsonl", traj.records)
        if learner.nonfinite_run >= cfg.train.max_nonfinite_skips:
            if writer:
                writer.write(learner.step, m)
                writer.close()
            learner.save(rollouter.state_dict(), force=True)
            learner.close()
            rollouter.close()
            raise NonFiniteError(f"stopped at step {learner.step}: {learner.nonfinite_run} consecutive steps had a "
                                 f"non-finite loss or gradient (nothing was applied; checkpoint saved at step "
                                 f"{learner.step} in {plan.workdir / 'checkpoints'}); lower optim.lr or check the "
                                 "rewards/advantages")
        if plan.eval_due(learner.step):
            with clock.paused():
                m.update(evaluate(rollouter, learner))
        if writer:
            writer.write(learner.step, m)
        bar.update(m)
        learner.save(rollouter.state_dict())
        if cfg.train.max_train_seconds and distributed.agree(clock.seconds >= cfg.train.max_train_seconds):
            summary["stopped_early"] = f"max_train_seconds={cfg.train.max_train_seconds} reached"
            break
    end = learner.step
    learner.save(rollouter.state_dict(), force=True)
    learner.wait()
    train_s = clock.seconds
    if cfg.eval.at_end and rollouter.eval_episodes and end > start:
        summary["eval_end"] = m = evaluate(rollouter, learner)
        if writer:
            writer.write(end, m)
    learner.close()
    if writer:
        writer.close()
    bar.close()
    rollouter.close()
    summary.update({"end_step": end, "train_wall_s": train_s, "peak_rss_gb": metrics_lib.peak_rss_gb(),
                    "env_episodes": rollouter.runner.episodes})  # this process's share of the episodes
    if main:
        (plan.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
