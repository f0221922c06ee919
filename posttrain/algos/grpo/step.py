"""The GRPO update on the generic step (`posttrain.learn.step`): the `rl` config, step options, loss and updates.

Shapes: the legend in `posttrain.types`. The policy-ratio rule: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.algos.grpo import losses as losses_lib
from posttrain.algos.grpo.advantages import ADVANTAGES
from posttrain.errors import AT_LEAST_ONE, NONNEGATIVE, check_fields
from posttrain.learn import step as step_lib
from posttrain.learn.logprobs import score_logprobs
from posttrain.learn.state import merge_model, reference_states
from posttrain.types import RolloutBatch, TrainState


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The `rl` section: GRPO (Shao et al. 2024) and variants: Dr. GRPO, RLOO, clip-higher, dual clip, GSPO, DAPO.

    Attributes:
        group_size: samples per prompt (G), >= 2.
        prompts_per_step: prompts per step (P).
        advantage: grpo | dr_grpo | rloo.
        loss: ppo (clipped token ratio) | gspo (sequence ratio).
        eps_low: lower clip range of the ratio (-1: the loss's default, `losses.LOSS_DEFAULTS`).
        eps_high: upper clip range of the ratio (> eps_low: DAPO's clip-higher; -1: the loss's default).
        dual_clip_c: dual-clip bound on negative-advantage terms (Ye et al. 2020; 0: off, else > 1).
        beta: KL-to-reference coefficient (0: no reference model).
        kl_estimator: k1 | k2 | k3 (Schulman's KL approximations).
        aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm ("": the loss's default).
        norm_constant: the divisor of seq_mean_token_sum_norm (0: max_new_tokens).
        tis_cap: TIS cap, >= 1 (0: off; -1: `posttrain.config.plan.OFF_POLICY_TIS_CAP` at rollout.max_staleness > 0).
        num_microbatches: gradient-accumulation microbatches.
        ppo_epochs: passes over the batch's `minibatches` row blocks, one update each (1 x 1: ratio exactly 1).
        minibatches: row blocks per pass.
        dynamic_sampling: DAPO's dynamic sampling: groups whose rewards are all equal are redrawn.
        max_resample_rounds: the most resampling rounds per step under dynamic_sampling.
        overlong_filter: DAPO's overlong filter: truncated completions get no loss.
        packed: each prompt is computed once per group in training (prompt + its G completions in one row).
        moe_aux_coef: the MoE load-balancing loss coefficient (-1: the model's `MoEConfig.aux_loss_coef`).
        routing_replay: "replay": the train step selects the experts the sampler selected; "off" routes anew.
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

    def __post_init__(self):
        aggregations = ("",) + tuple(losses_lib.AGGREGATIONS)  # "": the loss's own (`with_loss_defaults`)
        check_fields(self, choices={"advantage": ADVANTAGES, "loss": losses_lib.POLICY_LOSSES,
                                    "kl_estimator": losses_lib.KL_ESTIMATORS, "aggregation": aggregations,
                                    "routing_replay": ("off", "replay")}, ranges={
            "group_size": (">= 2 (a group of 1 is its own baseline: every advantage, and so every policy gradient, "
                           "is zero)", lambda v: v >= 2),
            **dict.fromkeys(("prompts_per_step", "num_microbatches", "ppo_epochs", "minibatches"), AT_LEAST_ONE),
            "eps_low": ("in [0, 1) (or -1: the loss's default)", lambda v: v == -1 or 0 <= v < 1),
            "eps_high": (">= 0 (or -1: the loss's default)", lambda v: v == -1 or v >= 0),
            "beta": NONNEGATIVE, "norm_constant": NONNEGATIVE,
            "tis_cap": (">= 1 (a cap below 1 scales down every on-policy token's weight), 0 (off), or -1 (the run "
                        "plan's rule: on when rollout.max_staleness > 0)", lambda v: v in (-1, 0) or v >= 1),
            "dual_clip_c": ("0 (off) or > 1", lambda v: v == 0 or v > 1), "max_resample_rounds": NONNEGATIVE})

    def with_loss_defaults(self) -> "GRPOConfig":
        """This config with eps_low / eps_high (-1) and aggregation ("") set from `losses.LOSS_DEFAULTS`."""
        d = losses_lib.LOSS_DEFAULTS[self.loss]
        return dataclasses.replace(self, eps_low=d["eps_low"] if self.eps_low == -1 else self.eps_low,
                                   eps_high=d["eps_high"] if self.eps_high == -1 else self.eps_high,
                                   aggregation=self.aggregation or d["aggregation"])

    def step_options(self, *, temperature: float, max_new_tokens: int, lora_rank: int,
                     matmul_precision: str) -> StepOptions:
        """The step's static options (MoE coefficients: `with_moe`); max_new_tokens: the default norm_constant."""
        loss = losses_lib.LossConfig(
            policy_loss=self.loss, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip_c=self.dual_clip_c or None,
            kl_estimator=self.kl_estimator, beta=self.beta, aggregation=self.aggregation,
            norm_constant=self.norm_constant or float(max_new_tokens), tis_cap=self.tis_cap or None)
        return StepOptions(loss=loss, temperature=temperature, num_microbatches=self.num_microbatches,
                           lora_rank=lora_rank, ppo_epochs=self.ppo_epochs, minibatches=self.minibatches,
                           matmul_precision=matmul_precision)

    def rows_per_step(self, max_turns: int) -> int:
        """Rows of a step's batch: prompts when packed (one row per group, single-turn), else prompts x G."""
        return self.prompts_per_step if (self.packed and max_turns == 1) else self.prompts_per_step * self.group_size


class StepOptions(NamedTuple):
    """Static settings of the GRPO step (hashable); `with_moe` sets the MoE fields from the model."""

    loss: losses_lib.LossConfig
    temperature: float
    num_microbatches: int = 1
    moe_aux_coef: float = 0.0
    moe_z_coef: float = 0.0
    bias_update_rate: float = 0.0
    lora_rank: int = 0
    logprob_chunk: int = 256
    ppo_epochs: int = 1
    minibatches: int = 1
    matmul_precision: str = "default"  # of the logprob matmuls (the model's own dots follow its config)

    @property
    def updates_per_batch(self) -> int:
        return self.ppo_epochs * self.minibatches

    @property
    def step_settings(self) -> step_lib.StepSettings:
        return step_lib.StepSettings(num_microbatches=self.num_microbatches, bias_update_rate=self.bias_update_rate,
                                     loss_metric="policy/loss")


def with_moe(opts: StepOptions, moe, aux_coef: float = -1.0) -> StepOptions:
    """`opts` with the loaded model's MoE coefficients (moe None: unchanged); aux_coef >= 0 overrides load balance."""
    if moe is None:
        return opts
    return opts._replace(moe_aux_coef=aux_coef if aux_coef >= 0 else moe.aux_loss_coef, moe_z_coef=moe.z_loss_coef,
                         bias_update_rate=moe.bias_update_rate if moe.score_bias else 0.0)


class Context(NamedTuple):
    """Full-batch values of a step: loss denominators, reference states (or None), own-logprob ratio (may be traced)."""

    den: losses_lib.LossDenominators
    ref_states: tuple | None
    own_old: jax.Array | bool = True


def _scores(model, mb: RolloutBatch, opts: StepOptions, with_entropy: bool = False):
    return score_logprobs(model, mb, opts.temperature, opts.logprob_chunk, with_entropy, opts.matmul_precision)


def make_loss_fn(graphdef, opts: StepOptions):
    """The GRPO `loss_fn(params, frozen, microbatch, context) -> (loss, metrics)` of `learn.step`."""

    def loss_fn(params, frozen, mb: RolloutBatch, ctx: Context):
        model = merge_model(graphdef, params, frozen)
        out, aux = _scores(model, mb, opts, with_entropy=True)
        logp_ref = None
        if ctx.ref_states is not None:
            ref = nnx.merge(graphdef, *ctx.ref_states)
            logp_ref = jax.lax.stop_gradient(_scores(ref, mb, opts)[0].logp_BxT)
        mask = mb.loss_mask_NxC & mb.valid_N[:, None]
        own = jax.lax.stop_gradient(out.logp_BxT)
        old = own if mb.logp_old_NxC is None else jnp.where(ctx.own_old, own, mb.logp_old_NxC)
        loss, metrics = losses_lib.policy_loss(out.logp_BxT, mb.logp_sample_NxC, mb.advantages_N, mask, ctx.den,
                                               opts.loss, logp_old_BxT=old, logp_ref_BxT=logp_ref,
                                               entropy_BxT=out.entropy_BxT)
        diff = jnp.where(mask, jnp.abs(old - mb.logp_sample_NxC), 0.0)  # behaviour policy: trainer vs sampler
        metrics["rollout/logp_diff_mean"] = diff.sum() / jnp.maximum(ctx.den.num_tokens, 1.0)
        metrics["rollout/logp_diff_max"] = diff.max()
        if "load_balance_loss" in aux:
            share = 1.0 / opts.num_microbatches
            aux_loss = opts.moe_aux_coef * aux["load_balance_loss"] + opts.moe_z_coef * aux["router_z_loss"]
            loss = loss + share * aux_loss
            metrics["moe/load_balance_loss"] = share * aux["load_balance_loss"]
            metrics["moe/router_z_loss"] = share * aux["router_z_loss"]
            metrics["moe/expert_load"] = share * aux["expert_load"]
            if "ep_dropped_frac" in aux:
                metrics["moe/ep_dropped_frac"] = share * aux["ep_dropped_frac"]
        return loss, metrics

    return loss_fn


def context(state: TrainState, batch: RolloutBatch, opts: StepOptions, own_old=True) -> Context:
    """The full batch's `Context`: denominators over every policy token of every valid sample, the reference."""
    den = losses_lib.loss_denominators(batch.loss_mask_NxC & batch.valid_N[:, None])
    return Context(den=den, ref_states=reference_states(state, opts.loss.beta > 0), own_old=own_old)


def accumulate_gradients(graphdef, state: TrainState, batch: RolloutBatch, opts: StepOptions, own_old=True):
    """(grads like state.params, metrics): the batch's GRPO gradient, accumulated over `opts.num_microbatches`."""
    _, grads, metrics = step_lib.accumulate_gradients(make_loss_fn(graphdef, opts), state.params, state.frozen,
                                                      batch, context(state, batch, opts, own_old),
                                                      opts.num_microbatches)
    return grads, metrics


def behaviour_logprobs(graphdef, state: TrainState, batch: RolloutBatch, opts: StepOptions):
    """float32 [N, C] trainer logprobs of every slot under the current weights, no gradient, a microbatch at a time."""
    model = merge_model(graphdef, state.params, state.frozen)
    parts = opts.minibatches * opts.num_microbatches
    mbs = jax.tree.map(lambda x: step_lib.split_microbatches(x, parts), batch)
    logp = jax.lax.map(lambda mb: _scores(model, mb, opts)[0].logp_BxT, mbs)
    return jax.lax.stop_gradient(logp.reshape(batch.targets_NxC.shape))


def ppo_updates(graphdef, state: TrainState, batch: RolloutBatch, tx: optax.GradientTransformation, lr_schedule,
                opts: StepOptions):
    """(state, metrics {name: [U]}): `ppo_epochs` passes over `minibatches` contiguous row blocks, an update each."""
    B, U = opts.minibatches, opts.updates_per_batch
    R, N = batch.tokens_RxL.shape[0], batch.targets_NxC.shape[0]
    if R % (B * opts.num_microbatches) or N % (B * opts.num_microbatches):
        raise ValueError(f"rows {R} and samples {N} must be divisible by minibatches x num_microbatches = "
                         f"{B} x {opts.num_microbatches}")
    batch = batch.replace(logp_old_NxC=behaviour_logprobs(graphdef, state, batch, opts))
    blocks = jax.tree.map(lambda x: step_lib.split_microbatches(x, B), batch)
    loss_fn = make_loss_fn(graphdef, opts)

    def body(st, u):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, u % B, keepdims=False), blocks)
        return step_lib.update(loss_fn, st, mb, context(st, mb, opts, own_old=u == 0), tx, lr_schedule,
                               opts.step_settings)

    return jax.lax.scan(body, state, jnp.arange(U))


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """The pure GRPO step `(state, batch) -> (state, metrics)` (jit it with `learn.step.jit_step`).

    Several updates report means over updates (min / max metrics: 1 for a ratio, else 0, without a policy token).
    """
    if opts.updates_per_batch == 1:
        inner = step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings,
                                   context_fn=lambda state, batch: context(state, batch, opts))
    else:
        def inner(state, batch):
            state, per_update = ppo_updates(graphdef, state, batch, tx, lr_schedule, opts)
            return state, {k: step_lib.reduce_updates(k, v) for k, v in per_update.items()}

    def step(state: TrainState, batch: RolloutBatch):
        state, metrics = inner(state, batch)
        for k in losses_lib.MIN_METRICS + losses_lib.MAX_METRICS:
            if k in metrics:
                metrics[k] = jnp.where(jnp.isinf(metrics[k]), 1.0 if "ratio" in k else 0.0, metrics[k])
        return state, metrics

    return step
