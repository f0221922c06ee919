"""The GRPO recipe, the only imperative driver of a run: plan -> rollouter / learner -> for each step: collect,
train, log, save, evaluate. No math and no derived settings live here (those are `posttrain.config.plan`'s);
the GRPO math is `posttrain.algos.grpo`'s (advantages handed to the rollouter, the step built on `learn.step`).

Outputs in the workdir: `metrics.jsonl`, TensorBoard events, `reward_curve.png`, `archive/step_*.parquet` (the
episode archive: one row per sample attempt, `posttrain.scheduling.archive`), `eval/step_*.jsonl`, `checkpoints/`
(Orbax), `summary.json`. Re-running the same command resumes from the last complete checkpoint with the same task
order and RNG stream.
"""
from __future__ import annotations

import dataclasses
import functools
import json
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
    """{key: [saved, new, checkpoint step]} of the settings a resumed run changes against its saved config.json
    (none when nothing will be restored: no complete checkpoint); `workdir.RESUME_FREE_KEYS` may change freely.
    Raises ConfigError listing them unless `allow` (--allow_config_change), and as `workdir.claim` does for a
    workdir that is a file, not writable, or another kind's run."""
    return workdir_lib.claim(plan.workdir, "grpo", plan.config_dict, defaults=to_dict(Config()),
                             free_keys=workdir_lib.RESUME_FREE_KEYS, allow_changes=allow)


def build(plan: RunPlan, *, reading: bool = False, restore: bool = True, allow_config_change: bool = False,
          held_out: bool = True) -> tuple[Rollouter, Learner, dict]:
    """The phases of a run: the policy loaded on the plan's mesh, the learner's train state (restored from the
    newest checkpoint in the workdir, if any, unless not `restore`: then the initial policy until
    `learner.restore()`), the rollouter (its scheduler and curriculum restored with it; with `plan.rewards`, a
    `rollout.rewards.RewardedRollouter` with the reward model and judge loaded) and the held-out episodes. Writes
    the workdir's config.json, unless `reading` (a command that only reads a run: then the run must hold a
    complete checkpoint, `require_checkpoint`).

    A command that only reads a run builds none of its training envs (env.train: recorded in its config, they
    need not be importable where the run is read; the rollouter then samples and steps the envs of the episodes
    it is given but draws no training tasks, `Rollouter.create(train=False)`), and its held-out envs (env.eval,
    the episodes returned) only with `held_out` (`posttrain eval` of the run's own eval envs; a suite evaluation,
    `sample` and `convert` use none: episodes {}). Raises ConfigError for an env it builds that cannot be built."""
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


def record_settings(plan: RunPlan, changes: dict[str, list]) -> None:
    """Writes the workdir's config.json and appends `changes` (`resume_changes`) to config_changes.jsonl, the
    record of what each stretch of steps ran with."""
    workdir_lib.write_config(plan.workdir, plan.config_dict)
    if changes and distributed.is_main_process():
        step = next(iter(changes.values()))[2]
        with (plan.workdir / "config_changes.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "changes": {k: v[:2] for k, v in changes.items()}}, default=str) + "\n")
        metrics_lib.log.warning("resuming from step %d with changed settings (recorded in %s): %s", step,
                                plan.workdir / "config_changes.jsonl",
                                "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in changes.items()))


def unreadable_note(checkpointer) -> str | None:
    """The loud line about checkpoints the last restore passed over (None when there were none): training moved
    them aside and trains their steps again; a reader (eval, convert) left them in place and used an older step."""
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
    """The run's metrics writer, with every output a run appends to cut back to `start` (the restored checkpoint's
    step; 0: a run starting over keeps nothing, its start-of-run evaluation runs again): metrics.jsonl, TensorBoard
    and the plot (`MetricsWriter(resume_step=start)`), the episode archive (archive/step_s holds the rollouts of
    update s + 1: s >= start go, `archive.cut`) and the eval records (eval/step_s: s > start go; all at 0)."""
    archive.cut(workdir, start)
    metrics_lib.cut_step_files(workdir / "eval", start + 1 if start else 0)
    return metrics_lib.MetricsWriter(workdir, resume_step=start)


def evaluate(plan: RunPlan, rollouter: Rollouter, learner: Learner, episodes: dict, *, write: bool = True) -> dict:
    """eval/* metrics of the learner's current policy on `episodes`; process 0 writes the records to
    eval/step_*.jsonl of the run, if `write` (training; a command that only reads a run writes nothing there)."""
    sample_fn = rollouter.sample_fn(learner.policy(), plan.eval_settings.sampling)
    m, records = eval_runner.run(plan.eval_settings, episodes, sample_fn, rollouter.tokenizer, rollouter.runner)
    if write and distributed.is_main_process():
        write_jsonl(plan.workdir / "eval" / f"step_{learner.step:06d}.jsonl", records)
    return m


def train(cfg: Config | RunPlan, *, workdir: str | None = None, progress: bool = True,
          allow_config_change: bool = False) -> dict:
    """Runs (or resumes) GRPO training as configured; returns the summary dict (also in summary.json).

    Raises ConfigError (before any work) for a config that makes no valid run plan, or that resumes a run with
    settings other than those its config.json saved (unless `allow_config_change`: then each change is recorded
    with its step in config_changes.jsonl), and NonFiniteError (after saving a checkpoint) when
    `train.max_nonfinite_skips` consecutive steps had a non-finite loss or gradient."""
    plan = cfg if isinstance(cfg, RunPlan) else make_run_plan(cfg, workdir=workdir)
    with use_rules(plan.rules):  # the activation sharding constraints traced by the sampler and the train step
        return _train(plan, progress, allow_config_change)


ZERO_VARIANCE_WARN_STEPS = 3  # consecutive steps whose every group had equal rewards before the run warns


def zero_variance_warning(run: int, metrics: dict) -> str | None:
    """The warning for `run` consecutive steps in which every group's rewards were equal (zero advantages: nothing
    to learn from), at ZERO_VARIANCE_WARN_STEPS and each multiple of it; None otherwise."""
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
    """A run opened as `train` opens it, each part pushed on `res` (which closes them in reverse order): the
    plan's warnings logged, the phases built (`build`, restored from the newest checkpoint), every output cut back
    to the restored step (`open_outputs`), the progress bar, and a fresh run's start-of-run evaluation
    (`eval.at_start`). Raises what `build` raises (ConfigError for a refused resume)."""
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
    summary = {"start_step": start, "config": plan.config_dict}
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
    """The steps of a run over its open parts (`open_run`; `train` and `GRPOTrainer` drive it). `resume`: the
    rollout state that matches the learner's (a stop saves it with the learner's state); `pending`: an update's
    metrics not written yet; `flat`: steps in a row whose every group had equal rewards; `summary`: the run's
    summary so far; `start`: the restored step; `metrics`: the last step's metrics row."""

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
        """Step `step` of `steps` and the stop check; True when train.max_train_seconds is reached or the eval gate
        stopped the run (noted in the summary). A stop signal or a run of non-finite steps saves the state first
        and raises (`stopped`)."""
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
        """The end of a run: the suite gate's verdict on the last step (`gate_step(final=True)`), the
        final checkpoint (forced, waited for), the end-of-run evaluation (`eval.at_end`,
        when the run moved past its start; not in the training seconds) and the summary with the end step,
        training seconds, peak memory and this process's share of the env episodes (process 0: summary.json)."""
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
        if distributed.is_main_process():
            (self.plan.workdir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))
        return self.summary

    def step(self, step: int, steps: int) -> None:
        """The step's batch from the queue (waited for only while it is not ready; a signal abandons the wait),
        the update and its record (not cut by a signal), evaluation when due (abandoned by a signal), metrics and
        the checkpoint (not cut). `resume`: the rollout state right after the producer made the trained batch."""
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
                "perf/weight_sync_s": sync_s, "perf/sampler_wait_s": sampler_wait_s})
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
        """The suite's gate when due (`LoopGate.due`): sampled with the training clock paused and the env runner
        the evaluation's; `m` gains eval/gate/* and the suite's seconds in perf/eval_s; a verdict checkpoints the
        step with its score, updates summary["eval_gate"] and, for a regression, warns (action "stop": the loop
        then finishes, summary["stopped_early"] saying why)."""
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
            raise learner.stop_checkpoint(self.resume, e.signal_name, start) from None
        learner.save(self.resume, force=True)
        learner.wait()
        raise e


def evaluate_run(plan: RunPlan) -> tuple[int, dict]:
    """(step, eval/* metrics) of the newest readable checkpoint of the run in `plan.workdir` on the plan's eval
    suite; the run is only read (no records written, an unreadable checkpoint left in place and named in an ERROR
    line). Only the run's env.eval envs are built (not its training envs). Raises RunNotFoundError (before loading
    anything) when the workdir holds no complete checkpoint, ConfigError naming env.eval.<name> when one of its eval
    envs cannot be built here (e.g. the module of a 'my_envs:Env-v0' id is not importable)."""
    with use_rules(plan.rules):
        rollouter, learner, episodes = build(plan, reading=True)
        with Resources(("the checkpointer", learner.close), ("the env workers", rollouter.close)):
            return learner.step, evaluate(plan, rollouter, learner, episodes, write=False)


def run_policy(plan: RunPlan):
    """(ModelConfig, nnx state, tokenizer) of the newest checkpoint of the run in `plan.workdir` (LoRA unmerged); no
    env of the run is built. Raises RunNotFoundError (before loading anything) when the workdir holds no complete
    checkpoint."""
    from flax import nnx

    rollouter, learner, _ = build(plan, reading=True, held_out=False)
    with Resources(("the checkpointer", learner.close), ("the env workers", rollouter.close)):
        state = nnx.state(nnx.merge(learner.graphdef, *learner.policy()))
    return learner.model_config, state, rollouter.tokenizer
