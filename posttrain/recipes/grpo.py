"""The GRPO recipe, a run's imperative driver: plan -> rollouter, learner -> per step: collect, train, log, save, eval.

The run's outputs and resume rules: docs/commands.md."""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Any

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.checkpoints.policy import load_policy
from posttrain.config import Config, ConfigError, to_dict
from posttrain.config.plan import RunPlan, check_envs, make_run_plan
from posttrain.eval import runner as eval_runner
from posttrain.infra import distributed, metrics as metrics_lib
from posttrain.infra import mesh as mesh_lib, reshard
from posttrain.infra.partitioning import use_rules
from posttrain.learn.learner import Learner, NonFiniteError
from posttrain.eval import gate_hook
from posttrain.recipes import plan as plan_command
from posttrain.runs import workdir as workdir_lib
from posttrain.runs.lookup import require_checkpoint
from posttrain.runs.resources import Resources
from posttrain.rollout import rewards as rewards_lib
from posttrain.rollout.queue import RolloutQueue, batch_metrics
from posttrain.rollout.rollouter import Rollouter, write_jsonl
from posttrain.scheduling import archive, status_table


def resume_changes(plan: RunPlan, allow: bool = False) -> dict[str, list]:
    """{key: [saved, new, checkpoint step]} of the settings a resume changes (RESUME_FREE_KEYS change freely).

    Raises ConfigError as `workdir.claim` does (changed settings only without `allow`: --allow_config_change)."""
    return workdir_lib.claim(plan.workdir, "grpo", plan.config_dict, defaults=to_dict(Config()),
                             free_keys=workdir_lib.RESUME_FREE_KEYS, allow_changes=allow)


def build(plan: RunPlan, *, reading: bool = False, restore: bool = True, allow_config_change: bool = False,
          held_out: bool = True) -> tuple[Rollouter, Learner, dict]:
    """Builds a run's phases after the pre-flight and env checks: (rollouter, learner, held-out episodes).

    The learner is restored from the newest checkpoint unless not `restore`; training writes config.json once restored.
    `reading` (a command that only reads a run: RunNotFoundError without a complete checkpoint) builds no training env,
    writes nothing and builds the held-out envs only with `held_out`. Raises PreflightError (training), and ConfigError
    for an env that cannot be built, a refused resume (`resume_changes`) or routing replay without MoE layers."""
    if reading:
        require_checkpoint(plan.workdir)
    else:  # the step's compiled peak against this machine's memory: before any worker start, load or write
        plan_command.check(plan)
    # every env used built once: a bad one stops before any load
    sources, episodes = check_envs(plan, train=not reading, held_out=held_out or not reading)
    changes = {} if reading else resume_changes(plan, allow_config_change)  # before any load or write
    mesh, rollout_mesh = mesh_lib.split_meshes(plan.mesh_shape, plan.rollout_mesh_shape)  # one mesh unless split
    model_config, graphdef, weights, tokenizer = load_policy(plan.policy, mesh, plan.rules)
    if plan.config.rl.routing_replay == "replay" and model_config.moe is None:  # replay would silently replay nothing
        raise ConfigError("rl.routing_replay='replay' replays the sampler's MoE expert selections, and this model "
                          "has no MoE layers: set rl.routing_replay='off'")
    learner = Learner.create(plan.learner_settings, mesh, model_config, graphdef, weights, plan.step_builder(),
                             read_only=reading)
    with Resources(("the checkpointer", learner.close)).on_error():  # a failed restore or env start closes it
        scored = plan.rewards is not None and not reading  # rewards.model / rewards.judge: loaded for training
        meta = learner.restore() if restore else None
        # a reader's rollouter draws no training tasks: no scheduler or curriculum state to restore (an offline run's
        # checkpoint has none either)
        rollouter = (rewards_lib.RewardedRollouter if scored else Rollouter).create(
            plan.rollout_settings, rollout_mesh, learner.graphdef, tokenizer, advantage_fn(plan.config.rl.advantage),
            meta=None if reading else meta, sources=sources, train=not reading)
        if scored:
            rewarder = rewards_lib.Rewarder.create(plan.rewards, tokenizer, mesh, plan.rules)
            rollouter = dataclasses.replace(rollouter, rewarder=rewarder)
    if not reading:  # restored (or new): the settings its next steps run with; a failed restore changed nothing
        record_settings(plan, changes)
    note = unreadable_note(learner.checkpointer)
    if note:
        metrics_lib.log.error(note)
    return rollouter, learner, episodes


def carried_summary(workdir, start: int) -> dict:
    """What a resumed run keeps of summary.json; {} for a run starting over.

    The segments that ended at or before `start` (the restored step; later ones are cut there, their steps trained
    again) and the run's start-of-run evaluation."""
    path = pathlib.Path(workdir) / "summary.json"
    if start == 0 or not path.is_file():
        return {}
    try:
        prev = json.loads(path.read_text())
    except ValueError:
        return {}
    segments = prev.get("segments") or ([{"start_step": prev["start_step"], "end_step": prev["end_step"],
                                          "train_wall_s": prev.get("train_wall_s", 0.0)}]
                                        if {"start_step", "end_step"} <= set(prev) else [])
    segments = [{**s, "end_step": min(s["end_step"], start)} for s in segments if s["start_step"] < start]
    return {"segments": segments, **({"eval_start": prev["eval_start"]} if "eval_start" in prev else {})}


def record_settings(plan: RunPlan, changes: dict[str, list]) -> None:
    """Writes config.json and appends `changes` (`resume_changes`) with their step to config_changes.jsonl."""
    workdir_lib.write_config(plan.workdir, plan.config_dict)
    if changes and distributed.is_main_process():
        step = next(iter(changes.values()))[2]
        with (plan.workdir / "config_changes.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "changes": {k: v[:2] for k, v in changes.items()}}, default=str) + "\n")
        metrics_lib.log.warning("resuming from step %d with changed settings (recorded in %s): %s", step,
                                plan.workdir / "config_changes.jsonl",
                                "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items()))
        effect = schedule_effect(plan, changes, step)
        if effect:
            metrics_lib.log.warning(effect)


SCHEDULE_KEYS = ("train.steps", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio", "optim.lr")


def schedule_effect(plan: RunPlan, changes: dict[str, list], step: int) -> str | None:
    """The warning for a resume that changes what the learning-rate schedule depends on (None when nothing did).

    It gives the rate of the next update under the saved and the new settings."""
    from posttrain.learn.optim import make_schedule

    changed = [k for k in SCHEDULE_KEYS if k in changes]
    if not changed:
        return None
    o, steps = plan.config.optim, plan.config.train.steps

    def lr_of(overrides):
        kw = {"lr": o.lr, "warmup_steps": o.warmup_steps, "total_steps": steps, "schedule": o.schedule,
              "min_lr_ratio": o.min_lr_ratio}
        kw.update(overrides)
        return float(make_schedule(**kw)(step))

    saved = {"total_steps" if k == "train.steps" else k.split(".")[1]: changes[k][0] for k in changed}
    try:
        before = lr_of(saved)
    except (TypeError, ValueError):
        before = None
    now = lr_of({})
    was = f"{before:.3g} under the saved settings" if before is not None else "not comparable"
    return (f"{', '.join(changed)} changed on resume: the learning-rate schedule is recomputed, so update {step + 1} "
            f"runs at lr {now:.3g} ({was}); the rest of the run follows the new schedule")


def unreadable_note(checkpointer) -> str | None:
    """The loud line about checkpoints the last restore passed over (training moved them aside), or None."""
    bad, step = checkpointer.unreadable, checkpointer.restored_step
    if not bad:
        return None
    steps = [r["step"] for r in bad]
    why = f"{len(bad)} unreadable checkpoint(s) {steps} in {checkpointer.directory} (step {steps[-1]}: " \
          f"{' '.join(bad[-1]['error'].split())[:200]})"
    if bad[0]["moved_to"] is None:
        return f"USING STEP {step}, NOT {steps[-1]}: {why}; left in place (only training moves one aside)"
    return (f"RESUMING FROM STEP {step}, NOT {steps[-1]}: {why} moved aside to "
            f"{', '.join(r['moved_to'] for r in bad)} (kept, never deleted); steps {step + 1}..{steps[-1]} are "
            "trained again")


def open_outputs(workdir, start: int) -> metrics_lib.MetricsWriter:
    """The run's metrics writer, after cutting each output a run appends to back to `start` (the restored step)."""
    archive.cut(workdir, start)
    metrics_lib.cut_step_files(workdir / "eval", start + 1 if start else 0)
    return metrics_lib.MetricsWriter(workdir, resume_step=start)


def evaluate(plan: RunPlan, rollouter: Rollouter, learner: Learner, episodes: dict, *, write: bool = True) -> dict:
    """eval/* metrics of the learner's current policy on `episodes`; with `write`, process 0 records them in eval/."""
    sample_fn = rollouter.sample_fn(learner.policy(), plan.eval_settings.sampling)
    m, records = eval_runner.run(plan.eval_settings, episodes, sample_fn, rollouter.tokenizer, rollouter.runner)
    if write and distributed.is_main_process():
        write_jsonl(plan.workdir / "eval" / f"step_{learner.step:06d}.jsonl", records)
    return m


def train(cfg: Config | RunPlan, *, workdir: str | None = None, progress: bool = True,
          allow_config_change: bool = False) -> dict:
    """Runs (or resumes) GRPO training as configured; returns the summary dict (also in summary.json).

    Raises:
        ConfigError: before any work, for a config that makes no valid run plan or a resume with changed settings
            (unless `allow_config_change`: each change is recorded in config_changes.jsonl).
        NonFiniteError: after saving a checkpoint, when `train.max_nonfinite_skips` steps in a row were non-finite."""
    plan = cfg if isinstance(cfg, RunPlan) else make_run_plan(cfg, workdir=workdir)
    with use_rules(plan.rules):  # the activation sharding constraints traced by the sampler and the train step
        return _train(plan, progress, allow_config_change)


ZERO_VARIANCE_WARN_STEPS = 3  # consecutive steps whose every group had equal rewards before the run warns


def zero_variance_warning(run: int, metrics: dict) -> str | None:
    """The warning at `run` steps in a row of equal rewards in every group (each ZERO_VARIANCE_WARN_STEPS), or None."""
    if not run or run % ZERO_VARIANCE_WARN_STEPS:
        return None
    mean = metrics.get("reward/mean", float("nan"))
    why = ("every reply fails: the task is too hard for the policy, or the reward never fires (check the env's "
           "verifier, sampling.max_new_tokens and the prompt format)" if mean == 0 else
           "every reply succeeds: the task is too easy" if mean >= 1 else
           "the rewards do not vary within a group (greedy or near-greedy sampling?)")
    return (f"{run} steps in a row where every group's rewards were equal (reward/mean {mean:.3g}): zero advantages, "
            f"zero policy gradient; {why}")


def _train(plan: RunPlan, progress: bool, allow_config_change: bool = False) -> dict:
    with distributed.StopRequest(plan.config.checkpoint.stop_grace_s) as stop, Resources() as res:
        loop = open_run(plan, res, stop, progress=progress, allow_config_change=allow_config_change)
        for step in range(loop.start, plan.config.train.steps):
            if loop.advance(step, plan.config.train.steps):
                break
        return loop.finish()


def open_run(plan: RunPlan, res: Resources, stop: distributed.StopRequest, *, progress: bool = True,
             allow_config_change: bool = False) -> "_Loop":
    """Opens a run as `train` does (`build`, `open_outputs`, start-of-run eval), each part pushed on `res`: its loop."""
    for warning in plan.warnings:
        metrics_lib.log.warning(warning)
    rollouter, learner, episodes = build(plan, allow_config_change=allow_config_change)
    res.push("the checkpointer", learner.close)
    res.push("the env workers", rollouter.close)
    start = learner.step
    main = distributed.is_main_process()  # process 0 writes metrics, plots, the archive and the summary
    writer = open_outputs(plan.workdir, start) if main else None
    if writer:
        res.push("the metrics writer", writer.close)
    bar = metrics_lib.ProgressBar(plan.config.train.steps, initial_step=start, disable=not (progress and main))
    res.push("the progress bar", bar.close)
    summary = {"start_step": start, "config": plan.config_dict, **carried_summary(plan.workdir, start)}
    if learner.checkpointer.unreadable:
        summary["unreadable_checkpoints"] = learner.checkpointer.unreadable
    if start == 0 and plan.config.eval.at_start and episodes:
        summary["eval_start"] = m = evaluate(plan, rollouter, learner, episodes)
        if writer:
            writer.write(0, m)
    gate = gate_hook.LoopGate.open(plan.gate, plan.workdir, plan.eval_settings, rollouter, learner.policy(),
                                   start)  # eval.suite: its baseline now
    if gate is not None:
        summary["eval_gate"] = gate.summary()
    clock = metrics_lib.TrainClock()  # training wall time: rollouts, updates, checkpoints; not in-loop eval
    loop = _Loop(plan, rollouter, learner, episodes, writer, bar, clock, stop, summary=summary, start=start,
                 resume=json.loads(json.dumps(rollouter.state_dict())), gate=gate)
    sync = functools.partial(reshard.onto, mesh=rollouter.mesh, rules=plan.rules) if plan.rollout_mesh_shape else None
    loop.queue = RolloutQueue(rollouter, start=start, steps=plan.config.train.steps, policy=learner.policy(), rng=learner.rng,
                              sync=sync)  # mesh.rollout: each version resharded onto the sampler's submesh
    res.push("the rollout producer", loop.queue.close)  # stopped before the env workers close
    return loop


@dataclasses.dataclass
class _Loop:
    """The steps of a run over its open parts (`open_run`), driven by `train` and `GRPOTrainer`.

    `resume`: the rollout state matching the learner's; `pending`: an update's metrics not yet written; `flat`: steps
    in a row of equal rewards in every group."""

    plan: RunPlan
    rollouter: Rollouter
    learner: Learner
    episodes: dict
    writer: Any  # metrics_lib.MetricsWriter on process 0, else None
    bar: Any  # metrics_lib.ProgressBar
    clock: Any  # metrics_lib.TrainClock
    stop: distributed.StopRequest
    resume: dict | None = None
    pending: dict | None = None
    flat: int = 0
    summary: dict = dataclasses.field(default_factory=dict)
    start: int = 0
    metrics: dict | None = None
    queue: Any = None  # rollout.queue.RolloutQueue: the producer of the batches (started by `open_run`)
    synced: Any = None  # the (policy, rng) snapshot of the last update, published to the producer by `advance`
    gate: Any = None  # eval.gate_hook.LoopGate with eval.suite, else None

    def advance(self, step: int, steps: int) -> bool:
        """Runs step `step` and the stop check; True when the time budget is spent or the eval gate stops the run.

        A stop signal or a run of non-finite steps saves the state first and raises (`stopped`)."""
        try:
            self.step(step, steps)
            self.stop.check()
        except (NonFiniteError, distributed.RunInterrupted) as e:
            self.stopped(e, self.start)
        if self.gate is not None and self.gate.stopped:  # eval.gate.action=stop on a regression
            return True
        limit = self.plan.config.train.max_train_seconds
        if limit and distributed.agree(self.clock.seconds >= limit):
            self.summary["stopped_early"] = f"max_train_seconds={limit} reached"
            return True
        self.queue.publish(self.learner.step, self.synced)  # after every collective of the step (stop, agree)
        return False

    def finish(self) -> dict:
        """Ends the run: the gate's last verdict, final checkpoint, end-of-run evaluation and summary (summary.json)."""
        plan, learner = self.plan, self.learner
        end = learner.step
        gate_m: dict = {}
        self.gate_step(gate_m, final=True)  # eval.suite: the last step's verdict, when not gated yet
        if gate_m and self.writer:
            self.writer.write(end, gate_m)
        self.queue.close()  # no batch is left to make; one still queued (a time stop) is dropped
        learner.save(self.resume, force=True)
        learner.wait()
        train_s = self.clock.seconds
        if plan.config.eval.at_end and self.episodes and end > self.start:
            self.summary["eval_end"] = m = evaluate(plan, self.rollouter, learner, self.episodes)
            if self.writer:
                self.writer.write(end, m)
        self.summary.update({"end_step": end, "train_wall_s": train_s, "peak_rss_gb": metrics_lib.peak_rss_gb(),
                             "env_episodes": self.rollouter.runner.episodes})
        self.write_summary(end, train_s)
        return self.summary

    def write_summary(self, end: int, train_s: float, stopped_by: str = "") -> None:
        """Adds this segment (start, end, training seconds) to the run's segments and writes summary.json (process 0).

        The run's totals cover every segment a summary recorded: `run_train_wall_s` and the first `eval_start`."""
        segment = {"start_step": self.start, "end_step": end, "train_wall_s": train_s}
        if stopped_by:
            segment["stopped_by"] = stopped_by
        segments = [*self.summary.get("segments", ()), segment]
        self.summary.update({"segments": segments, "run_start_step": segments[0]["start_step"],
                             "run_train_wall_s": sum(s["train_wall_s"] for s in segments)})
        if distributed.is_main_process():
            (self.plan.workdir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))

    def step(self, step: int, steps: int) -> None:
        """One step: the queued batch, the update and its record, evaluation when due, metrics and the checkpoint.

        A signal abandons only the waits (batch, evaluation), never the update, its record or the checkpoint."""
        plan, rollouter, learner, queue = self.plan, self.rollouter, self.learner, self.queue
        t0 = time.perf_counter()
        ready, waited = queue.get(step)
        traj, t1 = ready.trajectories, time.perf_counter()
        with self.stop.deferred():
            sampler_wait_s = queue.yield_to_sampler()  # rollout.sampler_priority: a generation in progress first
            m = learner.update(traj.batch)
            self.resume, self.pending = ready.rollout_state, m
            self.synced, sync_s = queue.snapshot(learner.policy(), learner.rng)  # the next version's weights
            m.update(traj.metrics)
            m.update(metrics_lib.step_perf(traj.num_tokens, t0, t1, time.perf_counter()))
            m.update(batch_metrics(ready, waited, time.perf_counter() - t0), **{
                "perf/weight_sync_s": sync_s, "perf/sampler_wait_s": sampler_wait_s,
                "archive_step": step})  # the archive's step of the batch this update trained: the join column
            if self.writer:
                archive.write_step(plan.workdir, step, traj.records)
                status_table.write_status(plan.workdir, ready.status)  # `posttrain status` reads it
            if learner.nonfinite_run >= plan.config.train.max_nonfinite_skips:
                raise NonFiniteError(f"stopped at step {learner.step}: {learner.nonfinite_run} consecutive steps had "
                                     "a non-finite loss or gradient (nothing was applied; checkpoint saved at step "
                                     f"{learner.step} in {plan.workdir / 'checkpoints'}); lower optim.lr or check "
                                     "the rewards/advantages")
        if plan.eval_settings.due(learner.step, steps):
            with self.clock.paused(), queue.exclusive():  # the env runner is the evaluation's meanwhile
                m.update(evaluate(plan, rollouter, learner, self.episodes))
        self.gate_step(m)  # eval.suite's gate when due: eval/gate/* metrics, a checkpoint, a stop
        with self.stop.deferred():
            if self.writer:
                self.writer.write(learner.step, m)
            self.pending, self.metrics = None, m
            self.bar.update(m)
            self.flat = self.flat + 1 if m.get("frac_zero_std_groups") == 1.0 else 0
            warning = zero_variance_warning(self.flat, m)
            if warning:
                metrics_lib.log.warning(warning)
            learner.save(self.resume)

    def gate_step(self, m: dict, *, final: bool = False) -> None:
        """The suite's gate when due, the clock paused: `m` gains eval/gate/*; a verdict checkpoints the step with its
        score and, for a regression, warns (action "stop": the loop finishes, summary["stopped_early"] saying why)."""
        gate, step = self.gate, self.learner.step
        if gate is None or not gate.due(step, self.start, final=final):
            return
        with self.clock.paused(), self.queue.exclusive():
            decision, metrics, seconds = gate.check(step, self.plan.eval_settings, self.rollouter,
                                                    self.learner.policy())
        m.update(metrics)
        m["perf/eval_s"] = m.get("perf/eval_s", 0.0) + seconds
        if decision is None:  # nothing scored on both sides (infra errors): no verdict here, training goes on
            return
        self.learner.save(self.resume, force=True, metrics={gate_hook.SCORE: decision.score})
        self.summary["eval_gate"] = gate.summary()
        text = gate.verdict(decision)
        if text:
            metrics_lib.log.warning(text)
            if gate.stopped:
                self.summary["stopped_early"] = text

    def stopped(self, e: BaseException, start: int) -> None:
        """Writes the pending metrics and saves the learner with the matching rollout state (for a signal: when the
        run moved past `start`), then raises `e` (a signal: as RunInterrupted naming the step and checkpoint)."""
        learner = self.learner
        if self.writer and self.pending is not None:
            self.writer.write(learner.step, self.pending)
        if isinstance(e, distributed.RunInterrupted):  # the offline loop's stop too (`Learner.stop_checkpoint`)
            stop = learner.stop_checkpoint(self.resume, e.signal_name, start)
            self.write_summary(learner.step, self.clock.seconds, stopped_by=e.signal_name)
            raise stop from None
        learner.save(self.resume, force=True)
        learner.wait()
        raise e


def evaluate_run(plan: RunPlan) -> tuple[int, dict]:
    """(step, eval/* metrics) of the newest readable checkpoint of the run in `plan.workdir`, which is only read.

    Builds only its env.eval envs. Raises RunNotFoundError before loading anything, ConfigError for a bad env."""
    with use_rules(plan.rules):
        rollouter, learner, episodes = build(plan, reading=True)
        with Resources(("the checkpointer", learner.close), ("the env workers", rollouter.close)):
            return learner.step, evaluate(plan, rollouter, learner, episodes, write=False)


def run_policy(plan: RunPlan):
    """(ModelConfig, nnx state, tokenizer) of the run's newest checkpoint (LoRA unmerged; no env built)."""
    from flax import nnx

    rollouter, learner, _ = build(plan, reading=True, held_out=False)
    with Resources(("the checkpointer", learner.close), ("the env workers", rollouter.close)):
        state = nnx.state(nnx.merge(learner.graphdef, *learner.policy()))
    return learner.model_config, state, rollouter.tokenizer
