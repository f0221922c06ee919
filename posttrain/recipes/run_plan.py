"""The run plan: every setting a run derives from its config, computed once and validated before any I/O.

`make_run_plan(cfg)` reads the validated `Config` (see `posttrain.config`) and the device count, and returns a
frozen `RunPlan`: the precision policy, the resolved mesh shape and batch shards, the row multiple of the rollout
batch, the sampling parameters of training and evaluation rollouts, the logprob temperature, and the train step's
static options (loss, microbatches, updates per batch). The rollouter, the learner, the loop and the CLI read these
fields and derive nothing again. It loads no model, starts no worker and writes nothing; bad combinations raise
`ConfigError` (a ValueError) naming the keys.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Mapping

from posttrain.algos.grpo import losses as losses_lib
from posttrain.infra import mesh as mesh_lib
from posttrain.config import Config, ConfigError
from posttrain.infra.precision import PrecisionPolicy, resolve_policy
from posttrain.rollout.sampler import SamplingParams, logprob_temperature
from posttrain.algos.grpo.step import StepOptions


@dataclasses.dataclass(frozen=True)
class RunPlan:
    cfg: Config
    workdir: pathlib.Path
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]  # resolved axis sizes (no -1)
    rules: tuple  # logical-axis rules: mesh.RULES with the config's `mesh.rules` overlays
    batch_shards: int  # devices the batch is split over (mesh axes of the "batch" rule)
    row_multiple: int  # rollout rows are padded to a multiple of this: minibatches x microbatches x batch shards
    decode_multiple: int  # the sampler's decode widths stay multiples of this (of 8 and of the batch shards)
    sampling: SamplingParams  # training rollouts
    eval_sampling: SamplingParams
    logprob_temperature: float  # T of log_softmax(logits / T), shared by sampler and trainer
    step_options: StepOptions
    warnings: tuple[str, ...] = ()  # legal but suspect settings, logged when a run starts

    def eval_due(self, done: int) -> bool:
        """Whether the evaluation of `eval.every_steps` runs after `done` completed steps (the last step's is the
        `eval.at_end` one)."""
        every = self.cfg.eval.every_steps
        return bool(every) and done % every == 0 and done < self.cfg.train.steps


def step_options(cfg: Config) -> StepOptions:
    """The train step's static options from the config (MoE coefficients: see `with_moe`)."""
    rl = cfg.rl
    loss = losses_lib.LossConfig(
        policy_loss=rl.loss, eps_low=rl.eps_low, eps_high=rl.eps_high, dual_clip_c=rl.dual_clip_c or None,
        kl_estimator=rl.kl_estimator, beta=rl.beta, aggregation=rl.aggregation,
        norm_constant=(rl.norm_constant or float(cfg.sampling.max_new_tokens)), tis_cap=rl.tis_cap or None)
    return StepOptions(loss=loss, temperature=logprob_temperature(cfg.sampling.temperature),
                       num_microbatches=rl.num_microbatches, lora_rank=cfg.lora.rank, ppo_epochs=rl.ppo_epochs,
                       minibatches=rl.minibatches, matmul_precision=cfg.model.matmul_precision)


def truncation_warning(cfg: Config) -> str | None:
    """A warning when training rollouts sample from a truncated distribution (top-p < 1 or top-k > 0): the sampler's
    logprobs then belong to the truncated distribution and the trainer's to the full softmax, so the behaviour
    policy is not the one the loss assumes; TIS (`rl.tis_cap`) and the rollout/logp_diff metrics see the gap."""
    s = cfg.sampling
    if s.top_p < 1.0 or s.top_k > 0:
        return (f"sampling.top_p={s.top_p} / top_k={s.top_k} truncate the training rollouts' distribution: the "
                "trainer's logprobs are of the full softmax, so off-policy drift is built in (consider rl.tis_cap)")
    return None


def with_moe(opts: StepOptions, cfg: Config, moe) -> StepOptions:
    """`opts` with the MoE loss coefficients and routing-bias rate of the loaded model (its MoEConfig, or None):
    they come from the checkpoint, so they are known only once the model is."""
    if moe is None:
        return opts
    aux = cfg.rl.moe_aux_coef if cfg.rl.moe_aux_coef >= 0 else moe.aux_loss_coef
    return opts._replace(moe_aux_coef=aux, moe_z_coef=moe.z_loss_coef,
                         bias_update_rate=moe.bias_update_rate if moe.score_bias else 0.0)


def make_run_plan(cfg: Config, *, num_devices: int | None = None, workdir: str | None = None,
                  backend: str | None = None) -> RunPlan:
    """Derives and validates every run setting (no I/O).

    num_devices / backend default to the local JAX runtime's (all processes' devices). Raises ConfigError when the
    mesh does not fit the devices or the rows of one step (prompts, or prompts x group size when rows are not
    packed) do not split into minibatches x microbatches x batch shards.
    """
    import jax

    num_devices = jax.device_count() if num_devices is None else num_devices
    sizes = {axis: getattr(cfg.mesh, axis) for axis in mesh_lib.MESH_AXES}
    try:
        shape = mesh_lib.mesh_shape(sizes, num_devices)
    except ValueError as e:
        raise ConfigError(f"mesh {sizes} does not fit {num_devices} device(s): {e}") from e
    rules = mesh_lib.rules_with_overrides(cfg.mesh.rules)  # validated with the config
    shards = mesh_lib.batch_shards(shape, rules)
    rl = cfg.rl
    rows = rl.prompts_per_step if (rl.packed and cfg.env.max_turns == 1) else rl.prompts_per_step * rl.group_size
    split = rl.minibatches * rl.num_microbatches * shards
    if rows % split:  # padding would add whole fake rows to every microbatch on every device
        raise ConfigError(f"the {rows} rows of a step (rl.prompts_per_step={rl.prompts_per_step}"
                          f"{'' if rows == rl.prompts_per_step else f' x rl.group_size={rl.group_size}'}) do not divide "
                          f"into rl.minibatches={rl.minibatches} x rl.num_microbatches={rl.num_microbatches} x "
                          f"{shards} batch shards of the mesh {shape}: change one of them")
    try:
        sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
                                  top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k)
        eval_sampling = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature)
        policy = resolve_policy(cfg.model.dtype, cfg.model.param_dtype, cfg.model.matmul_precision, backend)
        opts = step_options(cfg)
    except ValueError as e:  # the config's own checks make these unreachable; keep the contract if they drift
        raise ConfigError(str(e)) from e
    return RunPlan(cfg=cfg, workdir=pathlib.Path(workdir or cfg.train.workdir), precision=policy, mesh_shape=shape,
                   rules=rules, batch_shards=shards, row_multiple=split, decode_multiple=math.lcm(8, shards), sampling=sampling,
                   eval_sampling=eval_sampling, logprob_temperature=opts.temperature, step_options=opts,
                   warnings=tuple(w for w in (truncation_warning(cfg),) if w))
