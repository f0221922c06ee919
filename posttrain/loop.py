"""The training loop, the only imperative driver: schedule -> rollout -> rewards -> advantages -> train_step ->
metrics -> checkpoint -> eval. No math lives here.

Outputs in the workdir: `metrics.jsonl`, TensorBoard events, `reward_curve.png`, `trajectories/step_*.jsonl`
(prompts, replies, rewards), `checkpoints/` (Orbax), `summary.json`. Re-running the same command resumes from the
last complete checkpoint with the same task order and RNG stream.
"""
from __future__ import annotations

import ctypes
import json
import math
import resource
import time

import jax
import numpy as np

from posttrain import batching, distributed, evaluate, metrics as metrics_lib, rollout, setup
from posttrain.config import Config, to_dict
from posttrain.run_plan import RunPlan, make_run_plan
from posttrain.sampler import SamplingParams, sample, shared_prefix_len, shrink_schedule


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _trim_host_heap() -> None:
    """Returns freed heap pages to the OS (glibc `malloc_trim`; a no-op elsewhere). Called before a checkpoint
    save: the train step's freed temporaries otherwise stay resident while orbax allocates its host copies on
    top of them, raising the peak RSS of a CPU run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def make_sample_fn(run: "setup.Run", params: SamplingParams):
    """(prompts, lengths, key, G) -> SampleOutput with the current policy (LoRA adapters merged)."""
    tok = run.tokenizer
    policy = run.policy_state()
    multiple = math.lcm(8, run.plan.batch_shards)  # decode widths stay divisible by the batch shards

    def fn(prompts, lengths, key, group_size):
        shared = shared_prefix_len(prompts, lengths)  # e.g. the chat template's system turn: prefilled once
        shrink = shrink_schedule(len(prompts) * group_size, multiple, steps=run.cfg.sampling.decode_shrink_steps)
        with jax.set_mesh(run.mesh):
            return sample(run.graphdef, policy, np.asarray(prompts), np.asarray(lengths), key,
                          group_size=group_size, params=params, stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id,
                          shared_prefix_len=shared, shrink=shrink)

    return fn


def run_eval(run: "setup.Run", step: int) -> dict:
    cfg = run.cfg
    m, records = evaluate.evaluate(make_sample_fn(run, run.plan.eval_sampling), run.tokenizer, run.runner, run.eval_episodes,
                                   batch_size=cfg.eval.batch_size, scorer=cfg.eval.scorer, max_turns=cfg.env.max_turns,
                                   pad_id=run.tokenizer.pad_id, key=jax.random.key(cfg.train.seed + 1),
                                   system_prompt=cfg.sampling.system_prompt, bucket=cfg.sampling.prompt_bucket)
    if distributed.is_main_process():
        path = run.workdir / "eval" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return m


def collect(run: "setup.Run", step: int, sample_fn) -> tuple[list, dict]:
    """Samples this step's groups; with dynamic sampling, redraws zero-variance groups (bounded rounds)."""
    cfg, G, P = run.cfg, run.cfg.rl.group_size, run.cfg.rl.prompts_per_step
    key = jax.random.fold_in(run.state.rng, step)  # invariant 10: a fresh key per step
    kept, spare, perf, rounds, drawn, filtered = [], [], {}, 0, 0, 0
    while len(kept) < P:
        tasks = run.scheduler.next_tasks(step * 1000 + rounds, P - len(kept))
        episodes = [rollout.Episode(run.train_specs[d].id, dict(run.train_specs[d].kwargs), t,
                                    seed=step * 100003 + drawn + i, domain=d) for i, (d, t) in enumerate(tasks)]
        drawn += len(episodes)
        samples, p = rollout.run_episodes(sample_fn, run.tokenizer, run.runner, episodes, group_size=G,
                                          max_turns=cfg.env.max_turns, key=jax.random.fold_in(key, rounds),
                                          pad_id=run.tokenizer.pad_id, bucket=cfg.sampling.prompt_bucket,
                                          system_prompt=cfg.sampling.system_prompt)
        perf = {k: perf.get(k, 0.0) + v for k, v in p.items()}
        groups = [samples[i * G:(i + 1) * G] for i in range(len(episodes))]
        for g in groups:
            informative = len({s.reward for s in g if s.status != "infra_error"}) > 1
            (kept if informative or not cfg.rl.dynamic_sampling else spare).append(g)
            filtered += int(cfg.rl.dynamic_sampling and not informative)
        rounds += 1
        if not cfg.rl.dynamic_sampling or rounds > cfg.rl.max_resample_rounds:
            break
    kept = (kept + spare)[:P]
    perf["rollout/resample_rounds"] = rounds - 1
    perf["rollout/groups_drawn"] = drawn
    perf["rollout/frac_groups_filtered"] = filtered / max(drawn, 1)  # zero-variance groups set aside (DAPO)
    for gi, g in enumerate(kept):
        for s in g:
            s.group = gi
    return [s for g in kept for s in g], perf


def advance_curriculum(run: "setup.Run", samples) -> dict:
    """Feeds this step's rewards (infra errors excluded) to the curriculum; domains whose level moved get their
    tasks at the new level from the next step on; mix weights follow it. Returns the curriculum/* metrics."""
    cur = run.curriculum
    moved = cur.update({d: [s.reward for s in samples if s.domain == d and s.status != "infra_error"]
                        for d in cur.names})
    setup.apply_levels(cur, run.train_specs, run.scheduler, [d for d in moved if cur.max_levels[d] > 0])
    run.scheduler.set_weights(cur.weights())
    return cur.metrics()


def archive(run: "setup.Run", step: int, samples) -> None:
    path = run.workdir / "trajectories" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"group": s.group, "domain": s.domain, "reward": s.reward, "status": s.status,
                                "truncated": s.truncated, "prompt": run.tokenizer.decode(s.prompt_ids),
                                "replies": s.texts}) + "\n")


class NonFiniteError(RuntimeError):
    """Training stopped after `train.max_nonfinite_skips` consecutive steps with a non-finite loss or gradient."""


def truncation_warning(cfg: Config) -> str | None:
    """A warning when training rollouts sample from a truncated distribution (top-p < 1 or top-k > 0): the sampler's
    logprobs then belong to the truncated distribution and the trainer's to the full softmax, so the behaviour
    policy is not the one the loss assumes; TIS (`rl.tis_cap`) and the rollout/logp_diff metrics see the gap."""
    s = cfg.sampling
    if s.top_p < 1.0 or s.top_k > 0:
        return (f"sampling.top_p={s.top_p} / top_k={s.top_k} truncate the training rollouts' distribution: the "
                "trainer's logprobs are of the full softmax, so off-policy drift is built in (consider rl.tis_cap)")
    return None


def train(cfg: Config | RunPlan, *, workdir: str | None = None, progress: bool = True) -> dict:
    """Runs (or resumes) GRPO training as configured; returns the summary dict (also in summary.json).

    Raises ConfigError (before any work) for a config that makes no valid run plan, and NonFiniteError (after
    saving a checkpoint) when `train.max_nonfinite_skips` consecutive steps had a non-finite loss or gradient."""
    plan = cfg if isinstance(cfg, RunPlan) else make_run_plan(cfg, workdir=workdir)
    warning = truncation_warning(plan.cfg)
    if warning:
        metrics_lib.log.warning(warning)
    run = setup.build(plan)
    cfg, start = run.cfg, int(run.state.step)
    main = distributed.is_main_process()  # process 0 writes metrics, plots, trajectories and the summary
    writer = metrics_lib.MetricsWriter(run.workdir, resume_step=start if start else None) if main else None
    bar = metrics_lib.ProgressBar(cfg.train.steps, initial_step=start, disable=not (progress and main))
    sampling = run.plan.sampling
    summary = {"start_step": start, "config": to_dict(cfg)}
    if start == 0 and cfg.eval.at_start and run.eval_episodes:
        m = run_eval(run, 0)
        if writer:
            writer.write(0, m)
        summary["eval_start"] = m
    # training wall time: the loop (rollouts, updates, checkpoints) minus in-loop evaluation
    t_loop, eval_s, step, nonfinite_run = time.perf_counter(), 0.0, start, 0
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        samples, perf = collect(run, step, make_sample_fn(run, sampling))
        if run.curriculum is not None:
            perf.update(advance_curriculum(run, samples))
        batch, roll = batching.assemble(samples, group_size=cfg.rl.group_size, advantage=cfg.rl.advantage,
                                        pad_id=run.tokenizer.pad_id, packed=cfg.rl.packed,
                                        overlong_filter=cfg.rl.overlong_filter, prompt_bucket=cfg.sampling.prompt_bucket,
                                        row_multiple=run.row_multiple)
        t1 = time.perf_counter()
        run.state, m = run.train_step(run.state, run.put_batch(batch))
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        t2 = time.perf_counter()
        if main:
            archive(run, step, samples)
        tokens = int(np.asarray(batch.loss_mask_NxC).sum())
        m.update(roll)
        m.update(perf)
        m.update({"perf/step_s": t2 - t0, "perf/train_s": t2 - t1, "perf/tokens_per_s": tokens / (t2 - t0),
                  "perf/peak_rss_gb": _peak_rss_gb()})
        done = step + 1
        nonfinite_run = nonfinite_run + 1 if m.get("policy/skipped_nonfinite", 0.0) > 0 else 0
        if nonfinite_run:
            metrics_lib.log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s): update skipped "
                                    "(%d in a row)", done, m.get("policy/loss"), m.get("optim/grad_norm"), nonfinite_run)
        if nonfinite_run >= cfg.train.max_nonfinite_skips:
            if writer:
                writer.write(done, m)
                writer.close()
            run.checkpointer.save(done, run.state, run.checkpoint_meta(), force=True)
            run.checkpointer.wait()
            run.checkpointer.close()
            run.close()
            raise NonFiniteError(f"stopped at step {done}: {nonfinite_run} consecutive steps had a non-finite loss or "
                                 f"gradient (nothing was applied; checkpoint saved at step {done} in "
                                 f"{run.workdir / 'checkpoints'}); lower optim.lr or check the rewards/advantages")
        if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and done < cfg.train.steps:
            t_eval = time.perf_counter()
            m.update(run_eval(run, done))
            eval_s += time.perf_counter() - t_eval
        if writer:
            writer.write(done, m)
        bar.update(m)
        if run.checkpointer.should_save(done):
            _trim_host_heap()
            run.checkpointer.save(done, run.state, run.checkpoint_meta())
        if cfg.train.max_train_seconds and distributed.agree(
                time.perf_counter() - t_loop - eval_s >= cfg.train.max_train_seconds):
            summary["stopped_early"] = f"max_train_seconds={cfg.train.max_train_seconds} reached"
            break
    end = int(run.state.step)
    _trim_host_heap()
    run.checkpointer.save(end, run.state, run.checkpoint_meta(), force=True)
    run.checkpointer.wait()
    train_s = time.perf_counter() - t_loop - eval_s
    if cfg.eval.at_end and run.eval_episodes and end > start:
        m = run_eval(run, end)
        if writer:
            writer.write(end, m)
        summary["eval_end"] = m
    run.checkpointer.close()
    if writer:
        writer.close()
    bar.close()
    run.close()
    summary.update({"end_step": end, "train_wall_s": train_s, "peak_rss_gb": _peak_rss_gb()})
    if main:
        (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
