"""The SFT update on the generic step: `make_train_step(graphdef, tx, lr_schedule, opts) -> step(state, batch)`.

Shapes: the legend in `posttrain.types`. The loss: the mean assistant-token NLL over the FULL batch (nats per token).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from posttrain.learn import step as step_lib
from posttrain.learn.logprobs import score_logprobs
from posttrain.learn.state import merge_model
from posttrain.types import RolloutBatch, TrainState


class StepOptions(NamedTuple):
    """Static settings of the SFT step (hashable); `with_moe` sets the MoE fields from the model."""

    num_microbatches: int = 1
    logprob_chunk: int = 256
    matmul_precision: str = "default"
    lora_rank: int = 0
    moe_aux_coef: float = 0.0
    moe_z_coef: float = 0.0
    bias_update_rate: float = 0.0

    @property
    def step_settings(self) -> step_lib.StepSettings:
        return step_lib.StepSettings(num_microbatches=self.num_microbatches, bias_update_rate=self.bias_update_rate)


def with_moe(opts: StepOptions, moe, aux_coef: float = -1.0) -> StepOptions:
    """`opts` with the loaded model's MoE coefficients (moe None: unchanged); aux_coef >= 0 overrides load balance."""
    if moe is None:
        return opts
    return opts._replace(moe_aux_coef=aux_coef if aux_coef >= 0 else moe.aux_loss_coef, moe_z_coef=moe.z_loss_coef,
                         bias_update_rate=moe.bias_update_rate if moe.score_bias else 0.0)


class Context(NamedTuple):
    """Full-batch values of a step: num_tokens, float32 max(1, assistant tokens)."""

    num_tokens: jax.Array


def assistant_mask(batch: RolloutBatch) -> jax.Array:
    """bool [N, C]: the slots the loss trains (assistant tokens of valid rows)."""
    return batch.loss_mask_NxC & batch.valid_N[:, None]


def context(state: TrainState, batch: RolloutBatch) -> Context:
    """The full batch's `Context` (the loss denominator)."""
    return Context(num_tokens=jnp.maximum(assistant_mask(batch).sum().astype(jnp.float32), 1.0))


def token_nll(model, batch: RolloutBatch, opts: StepOptions):
    """(nll_NxC float32 nats, zeroed on untrained slots; mask_NxC bool; aux) of `batch` under `model`."""
    out, aux = score_logprobs(model, batch, 1.0, opts.logprob_chunk, precision=opts.matmul_precision)
    mask = assistant_mask(batch)
    return jnp.where(mask, -out.logp_BxT, 0.0), mask, aux


def make_loss_fn(graphdef, opts: StepOptions):
    """The SFT `loss_fn(params, frozen, microbatch, context) -> (loss, metrics)` of `learn.step`."""

    def loss_fn(params, frozen, mb: RolloutBatch, ctx: Context):
        nll, mask, aux = token_nll(merge_model(graphdef, params, frozen), mb, opts)
        loss = nll.sum() / ctx.num_tokens
        metrics = {"sft/loss": loss, "sft/tokens": mask.sum().astype(jnp.float32)}
        if "load_balance_loss" in aux:  # per-microbatch statistics: each microbatch adds 1 / M of its own
            share = 1.0 / opts.num_microbatches
            loss = loss + share * (opts.moe_aux_coef * aux["load_balance_loss"] + opts.moe_z_coef * aux["router_z_loss"])
            metrics["moe/load_balance_loss"] = share * aux["load_balance_loss"]
            metrics["moe/router_z_loss"] = share * aux["router_z_loss"]
            metrics["moe/expert_load"] = share * aux["expert_load"]
        return loss, metrics

    return loss_fn


def accumulate_gradients(graphdef, state: TrainState, batch: RolloutBatch, opts: StepOptions):
    """(loss, grads like state.params, metrics) of the batch, accumulated over `opts.num_microbatches`."""
    return step_lib.accumulate_gradients(make_loss_fn(graphdef, opts), state.params, state.frozen, batch,
                                         context(state, batch), opts.num_microbatches)


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """The pure SFT step `(state, batch) -> (state, metrics)`: one optimizer update (jitted by the learner)."""
    return step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings, context_fn=context)


def make_eval_fn(graphdef, opts: StepOptions):
    """Jitted `(params, frozen, batch) -> (nll_sum, tokens)`: float32 summed assistant-token NLL (nats), count."""

    @jax.jit
    def eval_fn(params, frozen, batch: RolloutBatch):
        nll, mask, _ = token_nll(merge_model(graphdef, params, frozen), batch, opts)
        return nll.sum(), mask.sum().astype(jnp.float32)

    return eval_fn


def perplexity(nll_sum: float, tokens: float) -> dict[str, float]:
    """{"sft/eval_loss": mean NLL (nats per token), "sft/ppl": its exp, "sft/eval_tokens"}; NaN for no tokens."""
    mean = nll_sum / tokens if tokens else math.nan
    return {"sft/eval_loss": mean, "sft/ppl": math.exp(mean) if tokens else math.nan, "sft/eval_tokens": tokens}
