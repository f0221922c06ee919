"""The rollout phase: the policy's samples on this step's tasks, scored by the environments, as a training batch.

Every process assembles the same batch: the env runner (`HostShardedEnvs`) shares the episodes out and gathers every
result. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, ContextManager, Mapping

import jax
import numpy as np

from posttrain.generate import streaming
from posttrain.generate.backend import EngineSampler, EngineSamplerSettings, SamplingConfig
from posttrain.generate.sampler import SamplingParams, sample, shared_prefix_len, shrink_schedule, template_prefix_len
from posttrain.infra import reshard
from posttrain.infra.partitioning import current_rules
from posttrain.rollout import attempts, batching, episodes
from posttrain.rollout.env_side import EnvConfig, EnvSpec, check_infra_errors, env_runner, task_sources
from posttrain.rollout.floor_metrics import above_floor_metrics, spec_floors
from posttrain.scheduling import status_table
from posttrain.scheduling.curriculum import CurriculumConfig, from_env_specs
from posttrain.scheduling.domain_rules import SchedulerSettings
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.weighted_draw import WeightedDraw
from posttrain.types import RolloutBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What the rollout phase needs of a run: its config sections and the plan's values for it.

    Attributes:
        env_config: the `env` section.
        sampling_config: the `sampling` section.
        objective: the `rl` section (`GRPOConfig`).
        curriculum_config: the `curriculum` section.
        queue_config: the `rollout` section (`RolloutConfig`).
        seed: seeds the task order.
        decode_multiple: decode widths are multiples of it.
        row_multiple: rows pad to a multiple of it (minibatches x microbatches x batch shards).
        record_routing: record the sampler's expert selections (routing replay).
        run: the run's name (the first field of every episode id).
        scheduler: the job scheduler's settings (None: the weighted draw).
        engine: the rollout engine's settings (None: the dense sampler).
    """

    env_config: EnvConfig
    sampling_config: SamplingConfig
    objective: Any
    curriculum_config: CurriculumConfig = CurriculumConfig()
    queue_config: Any = None
    seed: int = 0
    decode_multiple: int = 8
    row_multiple: int = 1
    record_routing: bool = False
    run: str = "run"
    scheduler: SchedulerSettings | None = None
    engine: EngineSamplerSettings | None = None

    @property
    def stream_chunk(self) -> int:
        """Streaming scoring's decode steps between deliveries (`generate.streaming`; 0: off)."""
        return self.queue_config.stream_chunk if self.queue_config is not None else 0


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """One step's rollouts: the batch (host numpy), its metrics, the archive rows and the oldest token's version."""

    batch: RolloutBatch
    metrics: dict[str, float]
    records: tuple[dict, ...]
    oldest_version: int | None = None

    @property
    def num_tokens(self) -> int:
        """Policy tokens the update trains on (the loss mask's count)."""
        return int(np.asarray(self.batch.loss_mask_NxC).sum())


def apply_levels(curriculum, train_specs: dict, scheduler, domains) -> None:
    """Puts each of `domains` at its curriculum level: in its env spec's kwargs and its scheduler task source."""
    for d in domains:
        spec = train_specs[d]
        train_specs[d] = dataclasses.replace(spec, kwargs={**dict(spec.kwargs), "level": curriculum.levels[d]})
        scheduler.set_source(d, task_sources({d: train_specs[d]})[d][2])


def make_scheduler(settings: RolloutSettings, sources: Mapping[str, Any]):
    """The run's task scheduler: the job scheduler when `settings.scheduler` is set, else the weighted draw."""
    weights = {n: settings.env_config.train[n].weight for n in sources}
    if settings.scheduler is None:
        return WeightedDraw(sources, weights, seed=settings.seed, group_size=settings.objective.group_size,
                            run=settings.run)

    return JobScheduler(sources, settings.scheduler, weights=weights)


def training_tasks(settings: RolloutSettings, meta: Mapping | None, sources: Mapping | None) -> tuple:
    """Returns (scheduler, train_specs, curriculum or None), restored from `meta`; EnvSpecError for a bad env."""
    train = dict(sources) if sources is not None else task_sources(settings.env_config.train)
    scheduler = make_scheduler(settings, {n: s for n, (_, _, s) in train.items()})
    train_specs, cur = dict(settings.env_config.train), None
    if settings.curriculum_config.enabled:

        cur = from_env_specs(train_specs, settings.curriculum_config)
    if meta is not None:
        scheduler.load_state_dict(meta["scheduler"])
        if cur is not None:
            cur.load_state_dict(meta["curriculum"])
    if cur is not None:  # every curriculum domain's tasks at its (start or restored) level
        apply_levels(cur, train_specs, scheduler, [d for d in cur.names if cur.max_levels[d] > 0])
        scheduler.set_weights(cur.weights())
    return scheduler, train_specs, cur


def _gated(fn: episodes.SampleFn, gate: Callable[[], ContextManager]) -> episodes.SampleFn:
    """`fn` with `gate()` held around each call until its outputs are computed (jax.block_until_ready)."""
    def gated(*args, **kwargs):
        with gate():
            return jax.block_until_ready(fn(*args, **kwargs))

    return gated


def write_jsonl(path: pathlib.Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@dataclasses.dataclass(frozen=True)
class Rollouter:
    """The rollout phase of a run; `train_specs` and `scheduler` change in place when the curriculum moves a level."""

    settings: RolloutSettings
    mesh: jax.sharding.Mesh
    graphdef: Any  # nnx.GraphDef of the policy, merged with the learner's policy states
    tokenizer: Any  # posttrain.model.tokenizer.Tokenizer
    runner: episodes.HostShardedEnvs
    scheduler: Any  # a scheduling.scheduler.Scheduler; None: create(train=False)
    train_specs: dict[str, EnvSpec]
    advantage_fn: batching.AdvantageFn  # the algorithm's advantages of a step's rewards
    curriculum: Any = None  # posttrain.scheduling.curriculum.DifficultyCurriculum when curriculum.enabled
    engine: EngineSampler | None = None  # the rollout engine behind sample_fn when settings.engine is set
    template_prefix: int = 0  # tokens every first prompt shares (`sampler.template_prefix_len`): prefilled once

    @classmethod
    def create(cls, settings: RolloutSettings, mesh, graphdef, tokenizer, advantage_fn: batching.AdvantageFn,
               meta: Mapping | None = None, sources: Mapping | None = None, train: bool = True) -> "Rollouter":
        """Builds the tasks, envs and scheduler of `settings`; `meta` (a checkpoint's) restores their state.

        `train` False (reading a run) builds no training task, scheduler or curriculum: `draw`, `collect`, `status` and
        `state_dict` then raise RuntimeError."""
        scheduler, train_specs, cur = training_tasks(settings, meta, sources) if train else (None, {}, None)
        runner = env_runner(settings.env_config)
        engine = EngineSampler(graphdef, settings.engine, mesh.devices.flat[0]) if settings.engine else None
        template = template_prefix_len(lambda m: episodes.chat_prompt(tokenizer, m, settings.sampling_config.system_prompt))
        return cls(settings=settings, mesh=mesh, graphdef=graphdef, tokenizer=tokenizer, runner=runner,
                   scheduler=scheduler, train_specs=train_specs, advantage_fn=advantage_fn, curriculum=cur,
                   engine=engine, template_prefix=template)

    def sample_fn(self, policy: tuple, params: SamplingParams) -> episodes.SampleFn:
        """Returns (prompts, lengths, key, G, on_rows=None) -> SampleOutput sampling with the policy states `policy`."""
        tok, st = self.tokenizer, self.settings
        policy = reshard.onto(policy, self.mesh, current_rules())
        if self.engine is not None:
            return self.engine.sample_fn(policy, params, tok.stop_ids, tok.pad_id, st.stream_chunk)

        def fn(prompts, lengths, key, group_size, on_rows=None):
            shared = shared_prefix_len(prompts, lengths, template=self.template_prefix)  # one length per run
            shrink = shrink_schedule(len(prompts) * group_size, st.decode_multiple, steps=st.sampling_config.decode_shrink_steps)
            every = st.stream_chunk if on_rows is not None else 0  # streaming scoring: finished rows to on_rows
            stream_id = streaming.register(on_rows) if every else 0
            try:
                with jax.set_mesh(self.mesh):
                    out = sample(self.graphdef, policy, np.asarray(prompts), np.asarray(lengths),
                                 reshard.onto(key, self.mesh),
                                 group_size=group_size, params=params, stop_ids=tuple(tok.stop_ids),
                                 pad_id=tok.pad_id, shared_prefix_len=shared, shrink=shrink,
                                 record_routing=st.record_routing,
                                 **(dict(stream_every=every, stream_id=np.int32(stream_id)) if every else {}))
                    return jax.block_until_ready(out) if every else out
            finally:
                if every:
                    streaming.unregister(stream_id)

        return fn

    def draw(self, step: int, sample_fn, key) -> tuple[list[episodes.Sample], dict, list[attempts.Attempt]]:
        """Returns (the batch's samples, metrics, every sample attempt) of step `step`, drawing until P groups are kept.

        Raises RuntimeError when no group could be completed, or for a rollouter built with `create(train=False)`."""
        self._require_tasks("draw training tasks")
        st = self.settings
        G, P = st.objective.group_size, st.objective.prompts_per_step
        d, rounds = attempts.StepDraw(G, st.objective.dynamic_sampling), 0
        while len(d.kept) < P:
            batch = self.scheduler.next_tasks(step, P - len(d.kept))
            if not batch:  # every domain paused, capped or quarantined (the job scheduler)
                break
            d.round(self._run_fn(step, sample_fn, key), batch, self.scheduler)
            rounds += 1
            if rounds > st.objective.max_resample_rounds:
                break
        samples, perf, tried = d.finish(P, rounds)
        if not samples:
            raise RuntimeError(f"step {step}: no group could be completed in {rounds} draw rounds (paused domains: "
                               f"{self.scheduler.paused()}, quarantined: {self.scheduler.quarantined()})")
        check_infra_errors(step, samples, st.env_config.max_infra_error_rate)
        return samples, perf, tried

    def _run_fn(self, step: int, sample_fn, key) -> attempts.RunFn:
        """Runs tickets of one size as episodes: reset seed step * 100003 + ticket id, key folded with the call."""
        st = self.settings

        def run(batch, size, call):
            specs = [self.train_specs[t.domain] for t in batch]
            eps = [episodes.Episode(spec.id, dict(spec.kwargs), t.task, seed=step * 100003 + t.ticket_id,
                                    domain=t.domain) for spec, t in zip(specs, batch)]
            return episodes.run_episodes(sample_fn, self.tokenizer, self.runner, eps, group_size=size,
                                        max_turns=st.env_config.max_turns, key=jax.random.fold_in(key, call),
                                        pad_id=self.tokenizer.pad_id, bucket=st.sampling_config.prompt_bucket,
                                        system_prompt=st.sampling_config.system_prompt, stream=st.stream_chunk > 0)

        return run

    def advance_curriculum(self, samples) -> dict:
        """Feeds this step's rewards to the curriculum and applies its levels and weights; returns curriculum/*."""
        cur = self.curriculum
        moved = cur.update({d: [s.reward for s in samples if s.domain == d and s.counts]
                            for d in cur.names})
        apply_levels(cur, self.train_specs, self.scheduler, [d for d in moved if cur.max_levels[d] > 0])
        self.scheduler.set_weights(cur.weights())
        return cur.metrics()

    def collect(self, step: int, policy: tuple, rng, policy_version: int | None = None,
                gate: Callable[[], ContextManager] | None = None) -> Trajectories:
        """Returns step `step`'s trajectories, sampled with `rng` folded with the step (a fresh key per step).

        Args:
            policy_version: the archive rows' version of samples whose tokens carry none (None: `step`).
            gate: a context manager held around each generation call (the rollout queue's `generating`).
        """
        st = self.settings
        if self.engine is not None:
            self.engine.pop_metrics()  # an evaluation's since the last step: not this step's
        fn = self.sample_fn(policy, st.sampling_config.params())
        if gate is not None:
            fn = _gated(fn, gate)
        samples, perf, tried = self.draw(step, fn, jax.random.fold_in(rng, step))
        perf.update(self.engine.pop_metrics() if self.engine is not None else {})
        if self.curriculum is not None:
            perf.update(self.advance_curriculum(samples))
        if st.scheduler is not None:
            perf.update(self.scheduler.metrics())
        batch, metrics = batching.assemble(samples, self.advantage_fn, group_size=st.objective.group_size,
                                           pad_id=self.tokenizer.pad_id, packed=st.objective.packed,
                                           overlong_filter=st.objective.overlong_filter, prompt_bucket=st.sampling_config.prompt_bucket,
                                           row_multiple=st.row_multiple)
        metrics.update(above_floor_metrics(metrics, spec_floors(self.train_specs)))
        return Trajectories(batch=batch, metrics={**metrics, **perf},
                            records=attempts.archive_rows(tried, self.tokenizer,
                                                         policy_version=step if policy_version is None
                                                         else policy_version),
                            oldest_version=min((v for s in samples if (v := s.oldest_version) is not None),
                                               default=None))

    def status(self, step: int, policy_version: int | None = None) -> dict:
        """The run view after step `step` (status.json, `status_table.snapshot`); RuntimeError without tasks."""
        self._require_tasks("report")
        levels = self.curriculum.levels if self.curriculum is not None else None
        return status_table.snapshot(step, self.scheduler, levels, policy_version)

    def _require_tasks(self, what: str) -> None:
        if self.scheduler is None:
            raise RuntimeError(f"this rollouter was built to read a run (Rollouter.create(train=False)): it has no "
                               f"task scheduler to {what}")

    def state_dict(self) -> dict:
        """The scheduler's (and curriculum's) state a checkpoint keeps; RuntimeError without training tasks."""
        self._require_tasks("save")
        meta = {"scheduler": self.scheduler.state_dict()}
        if self.curriculum is not None:
            meta["curriculum"] = self.curriculum.state_dict()
        return meta

    def close(self) -> None:
        self.runner.close()
