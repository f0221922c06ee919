"""The run plan: what a GRPO run derives from its config, computed once and checked before any I/O.

`make_run_plan` resolves the cross-section defaults, lays the mesh out, checks that a step's rows split over it and
derives the rest (components get their section plus these values). It loads no model, starts no worker, writes
nothing."""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from typing import Mapping

from posttrain.algos.grpo import step as grpo_step
from posttrain.algos.grpo.step import StepOptions, with_moe
from posttrain.checkpoints.policy import PolicySource
from posttrain.config.load import as_config, to_dict
from posttrain.config.schema import Config
from posttrain.errors import ConfigError
from posttrain.eval import gate as gate_lib, suite as suite_lib
from posttrain.eval.runner import EvalSettings
from posttrain.generate.backend import EngineSamplerSettings
from posttrain.generate.sampler import logprob_temperature
from posttrain.infra import mesh as mesh_lib
from posttrain.infra.precision import PrecisionPolicy, resolve_policy
from posttrain.learn.learner import LearnerSettings
from posttrain.rollout.env_side import EnvSpecError, probe_workers, task_sources
from posttrain.rollout.rewards import RewardSettings
from posttrain.rollout.rollouter import RolloutSettings
from posttrain.scheduling.domain_rules import SchedulerSettings

OFF_POLICY_TIS_CAP = 2.0  # rl.tis_cap = -1 at rollout.max_staleness > 0 (the cap C of Yao et al. 2025's TIS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A GRPO run's config with its cross-section defaults resolved, and every value derived from it.

    Attributes:
        config: the config the run trains with (what config.json records).
        workdir: the run's directory.
        config_dict: `config` as a plain dict (config.json, checkpoint metadata, the summary).
        precision: the resolved precision policy.
        mesh_shape: the learner's axis sizes (no -1).
        rules: logical-axis rules: mesh.RULES with the config's `mesh.rules` overlays.
        batch_shards: devices the batch is split over (mesh axes of the "batch" rule).
        rollout_mesh_shape: the rollout sampler's own submesh (`mesh.rollout`), or None (it shares `mesh_shape`).
        row_multiple: a step's rows pad to a multiple of it (minibatches x microbatches x batch shards).
        decode_multiple: decode widths are multiples of it (8 and the sampler's batch shards).
        logprob_temperature: T of every logprob, the trainer's and the sampler's alike.
        eval_seed: the evaluation sampling stream (`eval.seed`, or train.seed + 1).
        run_name: the first field of every episode id in the archive (the workdir's name).
        policy: where the policy comes from and how it is built.
        engine: the rollout engine's size, or None when the dense sampler samples.
        scheduler: the job scheduler's settings (None: tasks.enabled is off).
        gate: the in-loop evaluation suite and its gate (None: eval.suite is "").
        rewards: model and judge rewards after the env's (None: neither).
        warnings: legal but suspect settings, logged when a run starts."""

    config: Config
    workdir: pathlib.Path
    config_dict: dict
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]
    rules: tuple
    batch_shards: int
    rollout_mesh_shape: Mapping[str, int] | None = None
    row_multiple: int = 1
    decode_multiple: int = 8
    logprob_temperature: float = 1.0
    eval_seed: int = 1
    run_name: str = "run"
    policy: PolicySource
    engine: EngineSamplerSettings | None = None
    scheduler: SchedulerSettings | None = None
    gate: gate_lib.GateSettings | None = None
    rewards: RewardSettings | None = None
    warnings: tuple[str, ...] = ()

    @property
    def step(self) -> StepOptions:
        """The GRPO step's options before the loaded model's MoE coefficients (`model_step`)."""
        c = self.config
        return c.rl.step_options(temperature=self.logprob_temperature, max_new_tokens=c.sampling.max_new_tokens,
                                 lora_rank=c.lora.rank, matmul_precision=c.model.matmul_precision)

    def model_step(self, moe) -> StepOptions:
        """The step options for the loaded model (its MoEConfig or None): MoE coefficients and bias rate."""
        return with_moe(self.step, moe, self.config.rl.moe_aux_coef)

    def step_builder(self):
        """The learner's `build_step`: the GRPO step of this plan for the loaded model (its MoE coefficients)."""
        return lambda graphdef, tx, lr_schedule, model_config: grpo_step.make_train_step(
            graphdef, tx, lr_schedule, self.model_step(model_config.moe))

    @functools.cached_property
    def rollout_settings(self) -> RolloutSettings:
        c = self.config
        return RolloutSettings(env_config=c.env, sampling_config=c.sampling, objective=c.rl,
                               curriculum_config=c.curriculum, queue_config=c.rollout, seed=c.train.seed,
                               decode_multiple=self.decode_multiple, row_multiple=self.row_multiple,
                               record_routing=c.rl.routing_replay == "replay", run=self.run_name,
                               scheduler=self.scheduler, engine=self.engine)

    @functools.cached_property
    def learner_settings(self) -> LearnerSettings:
        c = self.config
        return LearnerSettings(workdir=self.workdir, optimizer=c.optim, total_steps=c.train.steps,
                               lora_rank=c.lora.rank, need_reference=c.rl.beta > 0, seed=c.train.seed,
                               checkpointing=c.checkpoint, rules=self.rules, config_dict=self.config_dict,
                               updates_per_step=c.rl.ppo_epochs * c.rl.minibatches,
                               best_metric="eval/gate/score" if self.gate else None)

    @functools.cached_property
    def eval_settings(self) -> EvalSettings:
        c = self.config
        return EvalSettings(eval_config=c.eval, env_config=c.env, sampling_config=c.sampling, seed=self.eval_seed)


def check_envs(plan: RunPlan, *, train: bool = True, held_out: bool = True) -> tuple[dict, dict]:
    """Builds the plan's envs once (with env workers, in a worker too) before any model load or worker start.

    Returns (env.train's `task_sources`, env.eval's episodes), {} for what `train` / `held_out` leave out. Raises
    ConfigError naming env.train.<name> or env.eval.<name>, its id, kwargs and the env's error."""
    from posttrain.eval import runner as eval_runner

    env = plan.config.env
    try:
        sources = task_sources(env.train) if train else {}
    except EnvSpecError as e:
        raise ConfigError(f"env.train.{e}") from e
    try:
        episodes = eval_runner.settings_episodes(plan.eval_settings) if held_out else {}
    except EnvSpecError as e:
        raise ConfigError(f"env.eval.{e}") from e
    check_model_graded(sources, plan.config.rewards)
    if env.num_workers > 0:  # what the workers cannot build fails here too, not as infra errors later
        from posttrain.rollout.episodes import Episode

        probes = {f"env.train.{n}": Episode(env_id, kwargs, source.get_task(0), seed=0)
                  for n, (env_id, kwargs, source) in sources.items()}
        probes.update({f"env.eval.{n}": eps[0] for n, eps in episodes.items() if eps})
        failed = probe_workers(probes, env.step_timeout_s)
        if failed:
            key = sorted(failed)[0]
            env_id, lines = probes[key].env_id, failed[key].strip().splitlines()
            raise ConfigError(f"{key}: id={env_id!r} cannot be built in an env worker (env.num_workers="
                              f"{env.num_workers}): {lines[0] if lines else 'no reason given'}; a worker "
                              "imports `envs` and the module named in a 'my.module:MyEnv-v0' id, nothing of this "
                              f"process: register the env in an importable module and name it "
                              f"'<module>:{env_id.split(':')[-1]}' (or set env.num_workers=0)")
    return sources, episodes


def check_model_graded(sources: dict, rewards) -> None:
    """Refuses task files whose rows need a grader model the run does not load.

    Raises ConfigError naming env.train.<name> when its rows name `rubric` without rewards.judge.enabled or
    `reward_model` without rewards.model."""
    from envs.tasks.task_file import ENV_ID, TaskFileTasks

    need = {"rubric": ("rewards.judge.enabled", rewards.judge.enabled), "reward_model": ("rewards.model",
                                                                                        bool(rewards.model))}
    for name, (env_id, _, source) in sources.items():
        if env_id != ENV_ID or not isinstance(source, TaskFileTasks):
            continue
        used = {s["name"] for i in range(source.num_tasks) for s in source.get_task(i)["verifier"]}
        missing = [setting for verifier, (setting, on) in need.items() if verifier in used and not on]
        if missing:
            raise ConfigError(f"env.train.{name}: its rows name model-graded verifiers ({sorted(used & set(need))}) "
                              f"that need {' and '.join(missing)}; set it, or give those rows another verifier")


def off_policy_defaults(cfg: Config) -> tuple[Config, str | None]:
    """(`cfg` with rl.tis_cap = -1 resolved, a warning or None): the off-policy rule.

    With rollout.max_staleness > 0 a batch may be sampled by an older policy than the one it trains, so the loss is
    PPO-clip on the decoupled ratio (AReaL's decoupled PPO, arXiv 2505.24298) weighted by the truncated importance
    weight min(pi_old / pi_sampler, C), C = OFF_POLICY_TIS_CAP; at 0, tis_cap = -1 is off. A value the config sets wins
    (tis_cap = 0 with staleness is warned about). Raises ConfigError for max_staleness > 0 or rollout.stream_chunk > 0
    under several processes (the producer thread's env exchanges would interleave with the learner's collectives)."""
    import jax

    k, rl = cfg.rollout.max_staleness, cfg.rl
    if k > 0 and jax.process_count() > 1:
        raise ConfigError(f"rollout.max_staleness={k} needs one process (this run has {jax.process_count()}): the "
                          "rollout producer's env exchanges would interleave with the learner's collectives; set "
                          "rollout.max_staleness=0")
    if cfg.rollout.stream_chunk > 0 and jax.process_count() > 1:
        raise ConfigError(f"rollout.stream_chunk={cfg.rollout.stream_chunk} needs one process (this run has "
                          f"{jax.process_count()}): streamed env steps would run the env runner's exchanges from a "
                          "second thread; set rollout.stream_chunk=0")
    warning = None
    if k > 0 and rl.tis_cap == 0:
        warning = (f"rollout.max_staleness={k} with rl.tis_cap=0: samples up to {k} policy versions old are trained "
                   "without importance correction (unclipped off-policy updates diverge); leave rl.tis_cap at -1 "
                   f"(C={OFF_POLICY_TIS_CAP}) or set a cap")
    if k > 0 and rl.loss != "ppo" and warning is None:
        warning = (f"rollout.max_staleness={k} with rl.loss={rl.loss!r}: the off-policy default is 'ppo' (PPO-clip "
                   "on the decoupled ratio); the TIS weight (rl.tis_cap) still corrects the lag")
    if rl.tis_cap == -1:
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(rl, tis_cap=OFF_POLICY_TIS_CAP if k > 0 else 0.0))
    return cfg, warning


def sampling_warnings(cfg: Config) -> list[str]:
    """Warnings for training rollouts that are greedy (every advantage zero) or truncated (off-policy by design)."""
    s, out = cfg.sampling, []
    if s.top_p < 1.0 or s.top_k > 0:
        out.append(f"sampling.top_p={s.top_p} / top_k={s.top_k} truncate the training rollouts' distribution: the "
                   "trainer's logprobs are of the full softmax, so off-policy drift is built in (consider rl.tis_cap)")
    if s.temperature == 0 or s.top_k == 1:
        out.append(f"sampling.temperature={s.temperature} / top_k={s.top_k} make the training rollouts greedy: the "
                   f"{cfg.rl.group_size} samples of a group are one reply, so every advantage (and the policy "
                   "gradient) is zero; sample with temperature > 0")
    return out


def resolve_mesh(mesh_cfg, num_devices: int, whose: str = "") -> tuple[dict, tuple, int]:
    """(axis sizes (no -1), rules with overlays, batch shards) of a `mesh` section; ConfigError if it cannot fit."""
    sizes = mesh_cfg.axis_sizes()
    try:
        shape = mesh_lib.mesh_shape(sizes, num_devices)
    except ValueError as e:
        raise ConfigError(f"mesh {sizes} does not fit {num_devices} device(s){whose}: {e}") from e
    rules = mesh_lib.rules_with_overrides(mesh_cfg.rules)  # validated with the config
    return shape, rules, mesh_lib.batch_shards(shape, rules)


def offline_layout(cfg, rows_key: str, rows: int, num_microbatches: int, num_devices: int | None,
                   backend: str | None):
    """(mesh shape, rules, batch shards, precision policy) of an offline run config (SFT, DPO, RM).

    Raises ConfigError when the mesh does not fit the devices, `rows` (named `rows_key`, e.g. "sft.rows_per_step") does
    not divide into `num_microbatches` x the batch shards, or the precision settings are invalid."""
    import jax

    shape, rules, shards = resolve_mesh(cfg.mesh, jax.device_count() if num_devices is None else num_devices)
    if rows % (num_microbatches * shards):
        section = rows_key.split(".")[0]
        raise ConfigError(f"{rows_key}={rows} does not divide into {section}.num_microbatches={num_microbatches} x "
                          f"{shards} batch shards of the mesh {shape}")
    m = cfg.model
    try:
        precision = resolve_policy(m.dtype, m.param_dtype, m.matmul_precision, backend)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return shape, rules, shards, precision


def _row_multiple(cfg: Config, shape, shards: int) -> int:
    """minibatches x microbatches x batch shards. Raises ConfigError when a step's rows do not split into it."""
    rl = cfg.rl
    rows = rl.rows_per_step(cfg.env.max_turns)
    split = rl.minibatches * rl.num_microbatches * shards
    if rows % split:  # padding would add whole fake rows to every microbatch on every device
        raise ConfigError(f"the {rows} rows of a step (rl.prompts_per_step={rl.prompts_per_step}"
                          f"{'' if rows == rl.prompts_per_step else f' x rl.group_size={rl.group_size}'}) "
                          "do not divide "
                          f"into rl.minibatches={rl.minibatches} x rl.num_microbatches={rl.num_microbatches} x "
                          f"{shards} batch shards of the mesh {shape}: change one of them")
    return split


def _gate(cfg: Config) -> gate_lib.GateSettings | None:
    """The evaluation gate, its suite read (None without eval.suite); ConfigError for a bad suite or every_steps < 1."""
    if not (e := cfg.eval).suite:
        return None
    if e.every_steps < 1:
        raise ConfigError(f"eval.suite={e.suite!r} runs every eval.every_steps steps: set eval.every_steps >= 1 "
                          f"(got {e.every_steps})")
    try:
        suite = suite_lib.load_suite(e.suite)
    except (OSError, ValueError) as err:
        raise ConfigError(f"eval.suite={e.suite!r}: {err}") from None
    return gate_lib.GateSettings(suite=suite, gate_config=e.gate, every_steps=e.every_steps)


def make_run_plan(cfg: Config, *, num_devices: int | None = None, workdir: str | None = None,
                  backend: str | None = None) -> RunPlan:
    """Derives and checks every value a GRPO run needs (no I/O).

    Args:
        cfg: a Config, or the ConfigDict a configs/*.py returns (`as_config`).
        num_devices, backend: default to the JAX runtime's (all processes' devices).
        workdir: replaces train.workdir.

    Raises:
        ConfigError: the mesh does not fit the devices, a step's rows do not split into minibatches x microbatches x
            batch shards, or a derived setting is refused (policy source, engine, scheduler, gate suite, rewards)."""
    import jax

    cfg = as_config(cfg)
    cfg, off_policy_warning = off_policy_defaults(dataclasses.replace(cfg, rl=cfg.rl.with_loss_defaults()))
    m = cfg.mesh
    devices = jax.device_count() if num_devices is None else num_devices
    try:
        rollout_shape = mesh_lib.rollout_shape(m.rollout, m.rollout_tensor, m.rollout_expert, devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    learn = devices - m.rollout
    shape, rules, shards = resolve_mesh(m, learn, f" (the learner's, besides mesh.rollout={m.rollout})"
                                        if rollout_shape else "")
    split = _row_multiple(cfg, shape, shards)
    decode_shards = mesh_lib.batch_shards(rollout_shape, rules) if rollout_shape else shards
    try:
        precision = resolve_policy(cfg.model.dtype, cfg.model.param_dtype, cfg.model.matmul_precision, backend)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    source = PolicySource.of(cfg.model, cfg.lora, precision, seed=cfg.train.seed)
    try:
        source.check()  # preset, overrides, vocabulary, model path: before any model load
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (workdir or cfg.train.workdir).strip():
        raise ConfigError("train.workdir='': name the run's directory (or pass --workdir)")
    wd = pathlib.Path(workdir or cfg.train.workdir)
    run_name = wd.name.replace(":", "_") or "run"
    scheduler = SchedulerSettings.of(cfg.tasks, sorted(cfg.env.train), group_size=cfg.rl.group_size,
                                     seed=cfg.train.seed, run=run_name)  # checked whether or not it is enabled
    engine = cfg.sampling.engine_settings(m.rollout or learn, default_slots=cfg.rl.prompts_per_step * cfg.rl.group_size,
                                          record_routing=cfg.rl.routing_replay == "replay",
                                          partial=cfg.rollout.partial)
    e = cfg.eval
    return RunPlan(config=cfg, workdir=wd, config_dict=to_dict(cfg), precision=precision, mesh_shape=shape,
                   rules=rules, batch_shards=shards, rollout_mesh_shape=rollout_shape, row_multiple=split,
                   decode_multiple=math.lcm(8, decode_shards),
                   logprob_temperature=logprob_temperature(cfg.sampling.temperature),
                   eval_seed=e.seed if e.seed >= 0 else cfg.train.seed + 1, run_name=run_name, policy=source,
                   engine=engine, scheduler=scheduler if cfg.tasks.enabled else None, gate=_gate(cfg),
                   rewards=RewardSettings.of(cfg.rewards, precision, seed=cfg.train.seed),
                   warnings=tuple(sampling_warnings(cfg) + [w for w in (off_policy_warning,) if w]))
