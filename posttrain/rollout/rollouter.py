"""The rollout phase: the policy's samples on this step's tasks, scored by the environments, as a training batch.

A `Rollouter` holds what rollouts need and nothing the update needs: the plan, the mesh and graphdef the sampler
runs on, the tokenizer, the environment runner, the task scheduler (and the curriculum that moves its levels),
and the held-out evaluation episodes. `collect(step, policy, rng)` returns `Trajectories`: the array-native
`RolloutBatch` (numpy, the full global batch on every process), the rollout metrics and the archive records.

Under several processes the sampler runs on the global mesh (every process passes the same prompts), and the
runner is a `rollout.HostShardedEnvs`: each process resets and steps only its share of the episodes, and the
results of all shares are exchanged, so every process assembles the same batch (`learner.Learner.update` places
its shards). Nothing here does gradient math; dimension legend: see `posttrain.types`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Mapping

import jax
import numpy as np

from posttrain.rollout import batching, episodes as rollout

from posttrain.eval import runner as evaluate_lib
from posttrain.config import Config, EnvSpec
from posttrain.recipes.run_plan import RunPlan
from posttrain.rollout.sampler import SamplingParams, sample, shared_prefix_len, shrink_schedule
from posttrain.tasks.scheduler import TaskScheduler
from posttrain.types import RolloutBatch


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """One step's rollouts. batch: the training batch (host numpy arrays; a new per-token or per-sample array is
    a new `RolloutBatch` field, filled in `batching.assemble`). metrics: reward/*, response_length/*, env/*,
    rollout/*, perf/{gen,reward,rollout}_s and curriculum/*. records: one JSON-able dict per sample, in batch
    order (group, domain, reward, status, truncated, prompt, replies), for the trajectory archive."""

    batch: RolloutBatch
    metrics: dict[str, float]
    records: tuple[dict, ...]

    @property
    def num_tokens(self) -> int:
        """Policy tokens the update trains on (the loss mask's count)."""
        return int(np.asarray(self.batch.loss_mask_NxC).sum())


def make_runner(cfg: Config) -> rollout.EnvRunner:
    """This process's env runner: in-process (env.num_workers = 0) or a pool of worker processes."""
    if cfg.env.num_workers <= 0:
        return rollout.InlineEnvs()
    from envs.pool.processes import EnvPool

    return EnvPool(num_workers=cfg.env.num_workers, step_timeout_s=cfg.env.step_timeout_s)


def task_sources(specs: Mapping[str, EnvSpec]) -> dict:
    """{name: (env_id, kwargs, task_source)}; constructing each env runs its golden self-check (invariant 7)."""
    import gymnasium

    import envs  # noqa: F401

    out = {}
    for name, spec in specs.items():
        env = gymnasium.make(spec.id, **dict(spec.kwargs)).unwrapped
        out[name] = (spec.id, dict(spec.kwargs), env.task_source)
    return out


def apply_levels(curriculum, train_specs: dict, scheduler: TaskScheduler, domains) -> None:
    """Puts each of `domains` at its curriculum level: its env spec gets kwargs["level"] (episodes are built from
    the specs) and the scheduler gets the task source of that level (same tasks, same cursor)."""
    for d in domains:
        spec = train_specs[d]
        train_specs[d] = dataclasses.replace(spec, kwargs={**dict(spec.kwargs), "level": curriculum.levels[d]})
        scheduler.set_source(d, task_sources({d: train_specs[d]})[d][2])


def archive_records(samples, tokenizer) -> tuple[dict, ...]:
    return tuple({"group": s.group, "domain": s.domain, "reward": s.reward, "status": s.status,
                  "truncated": s.truncated, "prompt": tokenizer.decode(s.prompt_ids), "replies": s.texts}
                 for s in samples)


def write_jsonl(path: pathlib.Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@dataclasses.dataclass(frozen=True)
class Rollouter:
    """The rollout phase of a run (see the module docstring). `train_specs` and `scheduler` change in place when
    the curriculum moves a level; `state_dict()` is what a checkpoint keeps of them."""

    plan: RunPlan
    mesh: jax.sharding.Mesh
    graphdef: Any  # nnx.GraphDef of the policy, merged with the learner's policy states
    tokenizer: Any  # posttrain.model.tokenizer.Tokenizer
    runner: rollout.HostShardedEnvs
    scheduler: TaskScheduler
    train_specs: dict[str, EnvSpec]
    eval_episodes: dict[str, list[rollout.Episode]]
    curriculum: Any = None  # posttrain.tasks.curriculum.DifficultyCurriculum when curriculum.enabled

    @classmethod
    def create(cls, plan: RunPlan, mesh, graphdef, tokenizer, meta: Mapping | None = None) -> "Rollouter":
        """Tasks, environments and scheduler of `plan`; `meta` (a checkpoint's) restores the scheduler's cursors
        and the curriculum's levels."""
        cfg = plan.cfg
        train = task_sources(cfg.env.train)
        scheduler = TaskScheduler({n: s for n, (_, _, s) in train.items()},
                                  {n: cfg.env.train[n].weight for n in train}, seed=cfg.train.seed)
        evals = evaluate_lib.eval_episodes(task_sources(cfg.env.eval), cfg.eval.num_tasks) if cfg.env.eval else {}
        train_specs, cur = dict(cfg.env.train), None
        if cfg.curriculum.enabled:
            from posttrain.tasks.curriculum import from_env_specs

            cur = from_env_specs(train_specs, cfg.curriculum)
        if meta is not None:
            scheduler.load_state_dict(meta["scheduler"])
            if cur is not None:
                cur.load_state_dict(meta["curriculum"])
        if cur is not None:  # every curriculum domain's tasks at its (start or restored) level
            apply_levels(cur, train_specs, scheduler, [d for d in cur.names if cur.max_levels[d] > 0])
            scheduler.set_weights(cur.weights())
        return cls(plan=plan, mesh=mesh, graphdef=graphdef, tokenizer=tokenizer,
                   runner=rollout.HostShardedEnvs(make_runner(cfg)), scheduler=scheduler, train_specs=train_specs,
                   eval_episodes=evals, curriculum=cur)

    def sample_fn(self, policy: tuple, params: SamplingParams) -> rollout.SampleFn:
        """(prompts, lengths, key, G) -> SampleOutput with the policy states `policy` (LoRA adapters merged)."""
        tok, plan = self.tokenizer, self.plan

        def fn(prompts, lengths, key, group_size):
            shared = shared_prefix_len(prompts, lengths)  # e.g. the chat template's system turn: prefilled once
            shrink = shrink_schedule(len(prompts) * group_size, plan.decode_multiple,
                                     steps=plan.cfg.sampling.decode_shrink_steps)
            with jax.set_mesh(self.mesh):
                return sample(self.graphdef, policy, np.asarray(prompts), np.asarray(lengths), key,
                              group_size=group_size, params=params, stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id,
                              shared_prefix_len=shared, shrink=shrink,
                              record_routing=plan.cfg.rl.routing_replay == "replay")

        return fn

    def draw(self, step: int, sample_fn, key) -> tuple[list[rollout.Sample], dict]:
        """Samples this step's groups; with dynamic sampling, redraws zero-variance groups (bounded rounds)."""
        cfg = self.plan.cfg
        G, P = cfg.rl.group_size, cfg.rl.prompts_per_step
        kept, spare, perf, rounds, drawn, filtered = [], [], {}, 0, 0, 0
        while len(kept) < P:
            tasks = self.scheduler.next_tasks(step * 1000 + rounds, P - len(kept))
            episodes = [rollout.Episode(self.train_specs[d].id, dict(self.train_specs[d].kwargs), t,
                                        seed=step * 100003 + drawn + i, domain=d) for i, (d, t) in enumerate(tasks)]
            drawn += len(episodes)
            samples, p = rollout.run_episodes(sample_fn, self.tokenizer, self.runner, episodes, group_size=G,
                                              max_turns=cfg.env.max_turns, key=jax.random.fold_in(key, rounds),
                                              pad_id=self.tokenizer.pad_id, bucket=cfg.sampling.prompt_bucket,
                                              system_prompt=cfg.sampling.system_prompt)
            perf = {k: perf.get(k, 0.0) + v for k, v in p.items()}
            for g in (samples[i * G:(i + 1) * G] for i in range(len(episodes))):
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

    def advance_curriculum(self, samples) -> dict:
        """Feeds this step's rewards (infra errors excluded) to the curriculum; domains whose level moved get their
        tasks at the new level from the next step on; mix weights follow it. Returns the curriculum/* metrics."""
        cur = self.curriculum
        moved = cur.update({d: [s.reward for s in samples if s.domain == d and s.status != "infra_error"]
                            for d in cur.names})
        apply_levels(cur, self.train_specs, self.scheduler, [d for d in moved if cur.max_levels[d] > 0])
        self.scheduler.set_weights(cur.weights())
        return cur.metrics()

    def collect(self, step: int, policy: tuple, rng) -> Trajectories:
        """Step `step`'s trajectories from the policy states `policy`, sampled with keys from the run's `rng`
        folded with the step (invariant 10: a fresh key per step)."""
        cfg = self.plan.cfg
        samples, perf = self.draw(step, self.sample_fn(policy, self.plan.sampling), jax.random.fold_in(rng, step))
        if self.curriculum is not None:
            perf.update(self.advance_curriculum(samples))
        batch, metrics = batching.assemble(samples, group_size=cfg.rl.group_size, advantage=cfg.rl.advantage,
                                           pad_id=self.tokenizer.pad_id, packed=cfg.rl.packed,
                                           overlong_filter=cfg.rl.overlong_filter,
                                           prompt_bucket=cfg.sampling.prompt_bucket,
                                           row_multiple=self.plan.row_multiple)
        return Trajectories(batch=batch, metrics={**metrics, **perf},
                            records=archive_records(samples, self.tokenizer))

    def evaluate(self, policy: tuple) -> tuple[dict, list]:
        """(eval/* metrics, per-task records) of the policy states `policy` on the held-out episodes."""
        cfg = self.plan.cfg
        return evaluate_lib.evaluate(self.sample_fn(policy, self.plan.eval_sampling), self.tokenizer, self.runner,
                                     self.eval_episodes, batch_size=cfg.eval.batch_size, scorer=cfg.eval.scorer,
                                     max_turns=cfg.env.max_turns, pad_id=self.tokenizer.pad_id,
                                     key=jax.random.key(cfg.train.seed + 1), system_prompt=cfg.sampling.system_prompt,
                                     bucket=cfg.sampling.prompt_bucket)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollouts: the scheduler's cursors (and the curriculum's state)."""
        meta = {"scheduler": self.scheduler.state_dict()}
        if self.curriculum is not None:
            meta["curriculum"] = self.curriculum.state_dict()
        return meta

    def close(self) -> None:
        self.runner.close()
