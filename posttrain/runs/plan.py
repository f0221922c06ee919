"""The run plan: every setting a run derives from its config, computed once and validated before any I/O.

`make_run_plan(cfg)` is the only reader of a `Config` (docs/design.md, "Configuration flows one way"): from the
validated config and the device count it builds a frozen `RunPlan` of each component's own typed settings
(`PolicySource`, `RolloutSettings`, `grpo.StepOptions`, `OptimizerSettings`, `LearnerSettings`, `EvalSettings`,
`TrainSettings`), the precision policy, the resolved mesh shape and its batch shards. The components read only their
settings and derive nothing again. It loads no model, starts no worker and writes nothing; bad combinations raise
`ConfigError` (a ValueError) naming the keys.

It lives in `recipes/` (above every component) rather than in `config/`, so that each settings type stays next to
the code it configures and names are checked against the registries themselves (ADVANTAGES, POLICY_LOSSES,
KL_ESTIMATORS, AGGREGATIONS, OPTIMIZERS, SCHEDULES, SCORERS): no second list of names to keep in step.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Mapping

from posttrain.algos.grpo import losses as losses_lib
from posttrain.algos.grpo.advantages import ADVANTAGES
from posttrain.algos.grpo import step as grpo_step
from posttrain.algos.grpo.step import StepOptions, with_moe
from posttrain.checkpoints.policy import PolicySource
from posttrain.config import Config, ConfigError, as_config, config_changes, to_dict
from posttrain.config.tasks import SchedulingOptions
from posttrain.eval import suite as suite_lib, gate as gate_lib
from posttrain.eval.runner import SCORERS, EvalSettings
from posttrain.infra import mesh as mesh_lib
from posttrain.infra.precision import PrecisionPolicy, resolve_policy
from posttrain.learn.learner import LearnerSettings
from posttrain.learn.offline_loop import TrainSettings
from posttrain.learn.optim import OPTIMIZERS, SCHEDULES, OptimizerSettings
from posttrain.rollout.rewards import JudgeSettings, RewardSettings
from posttrain.rollout.env_side import EnvSpecError, probe_workers, task_sources
from posttrain.rollout.rollouter import RolloutSettings
from posttrain.generate.backend import engine_settings
from posttrain.generate.sampler import SamplingParams, logprob_temperature
from posttrain.scheduling.domain_rules import SchedulerSettings, policies_from_mapping, resolve_policies

# (section, key) -> the registry whose keys are its allowed values
REGISTRY_NAMES = {("rl", "advantage"): ADVANTAGES, ("rl", "loss"): losses_lib.POLICY_LOSSES,
                  ("rl", "kl_estimator"): losses_lib.KL_ESTIMATORS, ("rl", "aggregation"): losses_lib.AGGREGATIONS,
                  ("optim", "name"): OPTIMIZERS, ("optim", "schedule"): SCHEDULES, ("eval", "scorer"): SCORERS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """Every derived setting of one run; the components' settings are all that code reads.

    Attributes:
        workdir: the run's directory.
        config_dict: the config as a plain dict (config.json, checkpoint metadata, the summary).
        precision: the resolved precision policy.
        mesh_shape: resolved axis sizes (no -1).
        rules: logical-axis rules: mesh.RULES with the config's `mesh.rules` overlays.
        batch_shards: devices the batch is split over (mesh axes of the "batch" rule).
        rollout_mesh_shape: the rollout sampler's own submesh (`mesh.rollout`; fsdp 1), or None (it shares
            `mesh_shape`, which is the learner's either way).
        policy: where the policy comes from and how it is built (PolicySource).
        rollout: the rollout phase's settings (RolloutSettings).
        advantage: an ADVANTAGES name (the rollout phase is handed its function).
        step: the GRPO step's options before the loaded model's MoE coefficients (`model_step`).
        moe_aux_coef: rl.moe_aux_coef (< 0: the model's own).
        learner: the update phase's settings (LearnerSettings).
        eval: held-out evaluation's settings (EvalSettings).
        train: the loop's own settings (TrainSettings).
        warnings: legal but suspect settings, logged when a run starts.
        tasks: the job scheduler's settings (None: tasks.enabled is off).
        gate: the in-loop evaluation suite and its gate (GateSettings; None: eval.suite is "").
        rewards: model and judge rewards after the env's (`rollout.rewards.RewardSettings`; None: neither).
    """

    workdir: pathlib.Path
    config_dict: dict
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]
    rules: tuple
    batch_shards: int
    policy: PolicySource
    rollout: RolloutSettings
    advantage: str
    step: StepOptions
    moe_aux_coef: float
    learner: LearnerSettings
    eval: EvalSettings
    train: TrainSettings
    warnings: tuple[str, ...] = ()
    tasks: SchedulerSettings | None = None
    gate: gate_lib.GateSettings | None = None
    rewards: RewardSettings | None = None
    rollout_mesh_shape: Mapping[str, int] | None = None

    def model_step(self, moe) -> StepOptions:
        """The step options for the loaded model (its MoEConfig or None): MoE coefficients and bias rate."""
        return with_moe(self.step, moe, self.moe_aux_coef)


def check_names(cfg: Config) -> None:
    """Raises ConfigError for a name that is not a key of its registry (REGISTRY_NAMES)."""
    for (section, key), registry in REGISTRY_NAMES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in registry:
            raise ConfigError(f"{section}.{key}={value!r}; expected one of {tuple(registry)}")


def check_envs(plan: RunPlan, *, train: bool = True, held_out: bool = True) -> tuple[dict, dict]:
    """Builds the plan's envs once (self-checks) before any model load or worker start: (env.train's `task_sources`
    unless not `train`, env.eval's episodes unless not `held_out`; {} if skipped); with env workers one worker starts
    each too. Raises ConfigError naming env.train.<name> / env.eval.<name>, its id, kwargs and the env's error (an
    id not registered or its module not importable: the registered ids and the `module:Env-v0` form; a worker's too)."""
    from posttrain.eval import runner as eval_runner

    try:
        train = task_sources(plan.rollout.train_specs) if train else {}
    except EnvSpecError as e:
        raise ConfigError(f"env.train.{e}") from e
    try:
        episodes = eval_runner.settings_episodes(plan.eval) if held_out else {}
    except EnvSpecError as e:
        raise ConfigError(f"env.eval.{e}") from e
    if plan.rollout.num_workers > 0:  # what the workers cannot build fails here too, not as infra errors later
        from posttrain.rollout.episodes import Episode

        probes = {f"env.train.{n}": Episode(env_id, kwargs, source.get_task(0), seed=0)
                  for n, (env_id, kwargs, source) in train.items()}
        probes.update({f"env.eval.{n}": eps[0] for n, eps in episodes.items() if eps})
        failed = probe_workers(probes, plan.rollout.step_timeout_s)
        if failed:
            key = sorted(failed)[0]
            env_id, lines = probes[key].env_id, failed[key].strip().splitlines()
            raise ConfigError(f"{key}: id={env_id!r} cannot be built in an env worker (env.num_workers="
                              f"{plan.rollout.num_workers}): {lines[0] if lines else 'no reason given'}; a worker "
                              "imports `envs` and the module named in a 'my.module:MyEnv-v0' id, nothing of this "
                              f"process: register the env in an importable module and name it "
                              f"'<module>:{env_id.split(':')[-1]}' (or set env.num_workers=0)")
    return train, episodes


def scheduler_settings(cfg: Config, run: str) -> SchedulerSettings:
    """The job scheduler's settings of the config's `tasks` section (policies resolved against env.train, so a bad
    pattern or min_shares over 1 fail here). Raises ConfigError naming `tasks` and the scheduler's message."""
    t = cfg.tasks
    try:
        policies = policies_from_mapping(t.policies)
        resolve_policies(sorted(cfg.env.train), policies)
        options = {f.name: getattr(t, f.name) for f in dataclasses.fields(SchedulingOptions)}
        return SchedulerSettings(policies=policies, group_size=cfg.rl.group_size, seed=cfg.train.seed,
                                 run=run.replace(":", "_") or "run", **options)
    except ValueError as e:
        raise ConfigError(f"tasks: {e}") from None


RUN_SHAPE_SECTIONS = ("model", "lora")  # what a run's checkpoints are shaped by: always the run's own


def saved_config(workdir) -> Config | None:
    """The Config a run saved in `workdir`/config.json (what its steps ran with), or None when there is none.
    Raises ConfigError naming the file when it does not load."""
    import json

    from posttrain.config import from_config_dict

    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        return from_config_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError; a truncated file is a JSONDecodeError
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None


def config_for_run(workdir, cfg: Config | None = None) -> Config:
    """The config of a command that reads the run in `workdir` (eval, convert): its saved config.json alone; with
    `cfg` (a --config), cfg with the run's own `model` and `lora` sections (RUN_SHAPE_SECTIONS: what its
    checkpoints were trained as, so a forgotten --config.lora.rank cannot mismatch them; a difference is logged).
    Raises ConfigError when the run saved no config and no `cfg` is given."""
    saved = saved_config(workdir)
    if saved is None:
        if cfg is None:
            raise ConfigError(f"{workdir}: no config.json in it (not a run's directory?); pass the run's "
                              "--config=configs/X.py")
        return cfg
    if cfg is None:
        return saved
    from posttrain.infra.metrics import log

    theirs = {s: getattr(saved, s) for s in RUN_SHAPE_SECTIONS}
    differ = config_changes({s: to_dict(cfg)[s] for s in RUN_SHAPE_SECTIONS}, {s: to_dict(saved)[s] for s in theirs})
    if differ:
        log.warning("--checkpoint=%s: using the run's own %s", workdir,
                    ", ".join(f"{k}={new!r} (not {old!r})" for k, (old, new) in differ.items()))
    return dataclasses.replace(cfg, **theirs)


def with_loss_defaults(cfg: Config) -> Config:
    """`cfg` with rl.eps_low / rl.eps_high (-1) and rl.aggregation ("") set to its policy loss's own values
    (`losses.LOSS_DEFAULTS`: GSPO's sequence-ratio clip range and sequence mean, PPO's 0.2 and token mean); values
    the config sets are kept. The config a run records (config.json, checkpoints) holds the values used."""
    rl = cfg.rl
    if (defaults := losses_lib.LOSS_DEFAULTS.get(rl.loss)) is None:  # check_names names it
        return cfg
    rl = dataclasses.replace(rl, eps_low=defaults["eps_low"] if rl.eps_low == -1 else rl.eps_low,
                             eps_high=defaults["eps_high"] if rl.eps_high == -1 else rl.eps_high,
                             aggregation=rl.aggregation or defaults["aggregation"])
    return dataclasses.replace(cfg, rl=rl)


def greedy_warning(cfg: Config) -> str | None:
    """A warning when training rollouts are greedy (temperature 0 or top-k 1): the G samples of a group are then
    the same reply, every group's rewards are equal and every advantage is zero."""
    if (s := cfg.sampling).temperature == 0 or s.top_k == 1:
        return (f"sampling.temperature={s.temperature} / top_k={s.top_k} make the training rollouts greedy: the "
                f"{cfg.rl.group_size} samples of a group are one reply, so every advantage (and the policy gradient) "
                "is zero; sample with temperature > 0")
    return None


def truncation_warning(cfg: Config) -> str | None:
    """A warning when training rollouts sample from a truncated distribution (top-p < 1 or top-k > 0): the sampler's
    logprobs then belong to the truncated distribution and the trainer's to the full softmax, so the behaviour
    policy is not the one the loss assumes; TIS (`rl.tis_cap`) and the rollout/logp_diff metrics see the gap."""
    if (s := cfg.sampling).top_p < 1.0 or s.top_k > 0:
        return (f"sampling.top_p={s.top_p} / top_k={s.top_k} truncate the training rollouts' distribution: the "
                "trainer's logprobs are of the full softmax, so off-policy drift is built in (consider rl.tis_cap)")
    return None


def policy_source(cfg: Config, policy: PrecisionPolicy) -> PolicySource:
    """The one mapping of the config's `model` / `lora` sections (and the precision policy) to ModelConfig fields."""
    m = cfg.model
    fields = dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype, matmul_precision=policy.matmul_precision,
                  remat=m.remat, remat_names=tuple(m.remat_names), lora=cfg.lora if cfg.lora.rank else None,
                  moe_gmm_impl=m.moe_gmm_impl, moe_capacity_factor=m.moe_capacity_factor,
                  moe_ep_capacity_factor=m.moe_ep_capacity_factor, attention_impl=m.attention_impl,
                  grad_dtype=m.grad_dtype)
    return PolicySource(path=m.path, preset=m.preset, overrides=dict(m.overrides), seed=cfg.train.seed, fields=fields)


def step_options(cfg: Config) -> StepOptions:
    """The GRPO step's static options (MoE coefficients: `RunPlan.model_step`). The logprob temperature is decided
    here once (`sampler.logprob_temperature` of the training rollouts' temperature)."""
    rl = cfg.rl
    loss = losses_lib.LossConfig(
        policy_loss=rl.loss, eps_low=rl.eps_low, eps_high=rl.eps_high, dual_clip_c=rl.dual_clip_c or None,
        kl_estimator=rl.kl_estimator, beta=rl.beta, aggregation=rl.aggregation,
        norm_constant=(rl.norm_constant or float(cfg.sampling.max_new_tokens)), tis_cap=rl.tis_cap or None)
    return StepOptions(loss=loss, temperature=logprob_temperature(cfg.sampling.temperature),
                       num_microbatches=rl.num_microbatches, lora_rank=cfg.lora.rank, ppo_epochs=rl.ppo_epochs,
                       minibatches=rl.minibatches, matmul_precision=cfg.model.matmul_precision)


def optimizer_settings(cfg: Config) -> OptimizerSettings:
    """The run's optimizer: the config's `optim` section over `train.steps` updates (grad_clip_norm 0: off)."""
    o = cfg.optim
    return OptimizerSettings(name=o.name, lr=o.lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                             grad_clip_norm=o.grad_clip_norm or None, warmup_steps=o.warmup_steps,
                             total_steps=cfg.train.steps, schedule=o.schedule, min_lr_ratio=o.min_lr_ratio)


def _rows_and_split(cfg: Config, shape, shards: int) -> int:
    """The row multiple (minibatches x microbatches x batch shards); ConfigError when a step's rows do not split."""
    rl = cfg.rl
    rows = rl.prompts_per_step if (rl.packed and cfg.env.max_turns == 1) else rl.prompts_per_step * rl.group_size
    split = rl.minibatches * rl.num_microbatches * shards
    if rows % split:  # padding would add whole fake rows to every microbatch on every device
        raise ConfigError(f"the {rows} rows of a step (rl.prompts_per_step={rl.prompts_per_step}"
                          f"{'' if rows == rl.prompts_per_step else f' x rl.group_size={rl.group_size}'}) "
                          "do not divide "
                          f"into rl.minibatches={rl.minibatches} x rl.num_microbatches={rl.num_microbatches} x "
                          f"{shards} batch shards of the mesh {shape}: change one of them")
    return split


def gate_settings(cfg: Config) -> gate_lib.GateSettings | None:
    """The evaluation gate's settings (None without eval.suite), its suite file read and parsed. Raises
    ConfigError for a missing or malformed suite file, or eval.every_steps = 0 with a suite."""
    if not (e := cfg.eval).suite:
        return None
    if e.every_steps < 1:
        raise ConfigError(f"eval.suite={e.suite!r} runs every eval.every_steps steps: set eval.every_steps >= 1 "
                          f"(got {e.every_steps})")
    try:
        suite = suite_lib.load_suite(e.suite)
    except (OSError, ValueError) as err:
        raise ConfigError(f"eval.suite={e.suite!r}: {err}") from None
    return gate_lib.GateSettings(suite=suite, every_steps=e.every_steps, action=e.gate.action,
                                 max_drop=e.gate.max_drop, alpha=e.gate.alpha)


def resolve_mesh(mesh_cfg, num_devices: int, whose: str = "") -> tuple[dict, tuple, int]:
    """(axis sizes with no -1, logical-axis rules with the config's overlays, batch shards) of a `mesh` section on
    `num_devices` devices (GRPO, SFT and DPO runs). Raises ConfigError when the mesh does not fit the devices."""
    sizes = {axis: getattr(mesh_cfg, axis) for axis in mesh_lib.MESH_AXES}
    try:
        shape = mesh_lib.mesh_shape(sizes, num_devices)
    except ValueError as e:
        raise ConfigError(f"mesh {sizes} does not fit {num_devices} device(s){whose}: {e}") from e
    rules = mesh_lib.rules_with_overrides(mesh_cfg.rules)  # validated with the config
    return shape, rules, mesh_lib.batch_shards(shape, rules)


def resolve_rollout_mesh(m, num_devices: int) -> tuple[int, dict | None]:
    """(learner devices, the rollout sampler's submesh shape or None: `mesh.rollout_shape`) of a `mesh` section
    `m` on `num_devices` devices. Raises ConfigError for a rollout size or sub-shape that `rollout_shape` refuses."""
    try:
        return num_devices - m.rollout, mesh_lib.rollout_shape(m.rollout, m.rollout_tensor, m.rollout_expert,
                                                               num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_run_plan(cfg: Config, *, num_devices: int | None = None, workdir: str | None = None,
                  backend: str | None = None) -> RunPlan:
    """Derives and validates every run setting (no I/O).

    num_devices / backend default to the local JAX runtime's (all processes' devices). Raises ConfigError for a
    name that is not in its registry, when the mesh does not fit the devices or the rows of one step (prompts, or
    prompts x group size when rows are not packed) do not split into minibatches x microbatches x batch shards.
    `cfg`: a Config, or the ConfigDict a configs/*.py returns (`config.as_config`; else TypeError)."""
    import jax

    cfg, off_policy_warning = off_policy_defaults(with_loss_defaults(as_config(cfg)))
    check_names(cfg)
    learn, rollout_shape = resolve_rollout_mesh(cfg.mesh, jax.device_count() if num_devices is None else num_devices)
    shape, rules, shards = resolve_mesh(cfg.mesh, learn, f" (the learner's, besides mesh.rollout="
                                        f"{cfg.mesh.rollout})" if rollout_shape else "")
    split = _rows_and_split(cfg, shape, shards)
    decode_shards = mesh_lib.batch_shards(rollout_shape, rules) if rollout_shape else shards
    try:
        s = cfg.sampling
        sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                  top_k=s.top_k)
        eval_sampling = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature)
        precision = resolve_policy(cfg.model.dtype, cfg.model.param_dtype, cfg.model.matmul_precision, backend)
        opts = step_options(cfg)
    except ValueError as e:  # the config's own checks make these unreachable; keep the contract if they drift
        raise ConfigError(str(e)) from e
    source = policy_source(cfg, precision)
    try:
        source.check()  # preset, overrides, vocabulary, model path: before any model load
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (workdir or cfg.train.workdir).strip():
        raise ConfigError("train.workdir='': name the run's directory (or pass --workdir)")
    wd = pathlib.Path(workdir or cfg.train.workdir)
    config_dict = to_dict(cfg)
    rl, env = cfg.rl, cfg.env
    tasks = scheduler_settings(cfg, wd.name)  # validated whether or not it is enabled
    gate = gate_settings(cfg)
    rollout = RolloutSettings(
        train_specs=dict(env.train), group_size=rl.group_size, prompts_per_step=rl.prompts_per_step,
        sampling=sampling, max_turns=env.max_turns, prompt_bucket=s.prompt_bucket, system_prompt=s.system_prompt,
        decode_shrink_steps=s.decode_shrink_steps, decode_multiple=math.lcm(8, decode_shards), row_multiple=split,
        packed=rl.packed, overlong_filter=rl.overlong_filter, dynamic_sampling=rl.dynamic_sampling,
        max_resample_rounds=rl.max_resample_rounds, record_routing=rl.routing_replay == "replay",
        num_workers=env.num_workers, env_backend=env.backend, step_timeout_s=env.step_timeout_s,
        max_infra_error_rate=env.max_infra_error_rate, max_abs_reward=env.max_abs_reward, seed=cfg.train.seed,
        **dataclasses.asdict(cfg.rollout), curriculum=cfg.curriculum, run=tasks.run,
        tasks=tasks if cfg.tasks.enabled else None, engine=engine_settings(cfg, cfg.mesh.rollout or learn))
    learner = LearnerSettings(workdir=wd, optimizer=optimizer_settings(cfg), lora_rank=cfg.lora.rank,
                              need_reference=rl.beta > 0, seed=cfg.train.seed, checkpoint=cfg.checkpoint,
                              rules=rules, config_dict=config_dict, updates_per_step=rl.ppo_epochs * rl.minibatches,
                              best_metric="eval/gate/score" if gate else None)
    e = cfg.eval
    evaluation = EvalSettings(specs=dict(env.eval), sampling=eval_sampling, num_tasks=e.num_tasks,
                              batch_size=e.batch_size, scorer=e.scorer, max_turns=env.max_turns,
                              system_prompt=s.system_prompt, prompt_bucket=s.prompt_bucket,
                              seed=e.seed if e.seed >= 0 else cfg.train.seed + 1,
                              every_steps=e.every_steps, at_start=e.at_start, at_end=e.at_end)
    t = cfg.train
    return RunPlan(workdir=wd, config_dict=config_dict, precision=precision, mesh_shape=shape, rules=rules,
                   batch_shards=shards, rollout_mesh_shape=rollout_shape, policy=source, rollout=rollout, advantage=rl.advantage,
                   step=opts, moe_aux_coef=rl.moe_aux_coef, learner=learner, eval=evaluation,
                   train=TrainSettings(steps=t.steps, max_train_seconds=t.max_train_seconds,
                                       max_nonfinite_skips=t.max_nonfinite_skips,
                                       preflight_prompt_len=t.preflight_prompt_len),
                   warnings=tuple(w for w in (truncation_warning(cfg), greedy_warning(cfg), off_policy_warning) if w),
                   tasks=rollout.tasks, gate=gate, rewards=reward_settings(cfg, precision))


def offline_layout(cfg, rows_key: str, rows: int, num_microbatches: int, num_devices: int | None, backend: str | None):
    """(mesh shape, rules, batch shards, precision policy) of an offline run config's `mesh` and `model` sections.
    Raises ConfigError when the mesh does not fit the devices, `rows` (named `rows_key`, e.g. "sft.rows_per_step")
    does not divide into `num_microbatches` x the mesh's batch shards, or the precision settings are invalid."""
    import jax

    shape, rules, shards = resolve_mesh(cfg.mesh, jax.device_count() if num_devices is None else num_devices)
    if rows % (num_microbatches * shards):
        section = rows_key.split(".")[0]
        raise ConfigError(f"{rows_key}={rows} does not divide into {section}.num_microbatches={num_microbatches} x "
                          f"{shards} batch shards of the mesh {shape}")
    try:
        precision = resolve_policy(cfg.model.dtype, cfg.model.param_dtype, cfg.model.matmul_precision, backend)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return shape, rules, shards, precision


OFF_POLICY_TIS_CAP = 2.0  # rl.tis_cap = -1 at rollout.max_staleness > 0 (the cap C of Yao et al. 2025's TIS)


def off_policy_defaults(cfg: Config) -> tuple[Config, str | None]:
    """(`cfg` with rl.tis_cap = -1 resolved, a warning or None): the off-policy rule. With rollout.max_staleness > 0
    a batch may be sampled by an older policy than the one it trains, so the loss is PPO-clip on the decoupled
    ratio (`rl.loss` "ppo": the ratio's denominator is the trainer's own logprob, the proximal policy of AReaL's
    decoupled PPO, arXiv 2505.24298) weighted by the truncated importance weight min(pi_old / pi_sampler, C)
    (`rl.tis_cap`, C = OFF_POLICY_TIS_CAP); at 0, tis_cap = -1 is off. A value the config sets wins; an
    explicit tis_cap = 0 at max_staleness > 0 (no correction of the lag) is warned about. Raises ConfigError for
    max_staleness > 0 or rollout.stream_chunk > 0 under several processes (the producer thread's env exchanges
    would interleave with the learner's collectives)."""
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
    if k > 0 and rl.loss != "ppo":
        warning = (f"rollout.max_staleness={k} with rl.loss={rl.loss!r}: the off-policy default is 'ppo' (PPO-clip "
                   "on the decoupled ratio); the TIS weight (rl.tis_cap) still corrects the lag") if warning is None \
            else warning
    if rl.tis_cap == -1:
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(rl, tis_cap=OFF_POLICY_TIS_CAP if k > 0 else 0.0))
    return cfg, warning


def reward_settings(cfg, precision: PrecisionPolicy) -> RewardSettings | None:
    """The `RewardSettings` of `cfg.rewards` (a `Config`), None when neither a reward model nor a judge is used.
    Raises ConfigError naming rewards.model (no reward model there: no config.json, not a one-label
    *ForSequenceClassification) or rewards.judge (an unknown preset, a bad path, overrides without a preset)."""
    r = cfg.rewards
    if not r.enabled:
        return None
    fields = dict(dtype=precision.compute_dtype, param_dtype=precision.param_dtype,
                  matmul_precision=precision.matmul_precision)
    if r.model:
        from posttrain.checkpoints.reward_model import reward_model_dir

        try:
            reward_model_dir(r.model)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"rewards.model={r.model!r}: {' '.join(str(e).split())}") from None
    judge = None
    if r.judge.enabled:
        j = r.judge
        source = PolicySource(path=j.path, preset=j.preset, overrides=dict(j.overrides), seed=cfg.train.seed,
                              fields=fields)
        try:
            source.check()
        except ValueError as e:
            message = " ".join(str(e).split()).replace("model.", "rewards.judge.")
            raise ConfigError(f"rewards.judge: {message}") from None
        judge = JudgeSettings(source=source, template=j.template,
                              criteria=tuple((c["name"], float(c["weight"]), c["description"]) for c in j.criteria),
                              max_score=float(j.max_score), max_new_tokens=j.max_new_tokens, batch_size=j.batch_size,
                              unparsable_score=float(r.judge_unparsable_score))
    return RewardSettings(model_path=r.model, model_fields=fields, judge=judge, weights=dict(r.weights),
                          batch_size=r.batch_size, max_len=r.max_len)


def step_builder(plan: RunPlan):
    """The learner's `build_step`: the GRPO step of `plan` for the loaded model (its MoE coefficients)."""
    return lambda graphdef, tx, lr_schedule, model_config: grpo_step.make_train_step(
        graphdef, tx, lr_schedule, plan.model_step(model_config.moe))
