"""The DPO update on the generic step: `make_train_step(graphdef, tx, lr_schedule, opts) -> step(state, batch)`.

Shapes: the legend in `posttrain.types`. The reference rides in the batch (`ref_logp_N`); notes: docs/algorithms.md.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from posttrain.algos.dpo import losses
from posttrain.algos.dpo.data import PairBatch
from posttrain.learn import step as step_lib
from posttrain.learn.logprobs import score_logprobs
from posttrain.learn.state import merge_model
from posttrain.types import TrainState


class StepOptions(NamedTuple):
    """Static settings of the DPO step (hashable): a `losses.LOSSES` name and its parameters, chunking, precision."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    num_microbatches: int = 1
    logprob_chunk: int = 256
    matmul_precision: str = "default"
    lora_rank: int = 0

    @property
    def step_settings(self) -> step_lib.StepSettings:
        return step_lib.StepSettings(num_microbatches=self.num_microbatches, loss_metric="dpo/loss")


class Context(NamedTuple):
    """Full-batch values of a step: num_pairs, float32 max(1, valid pairs)."""

    num_pairs: jax.Array


def pair_valid(batch: PairBatch) -> jax.Array:
    """bool [P]: pairs whose two replies are both valid (padding rows are not)."""
    v = batch.valid_N.reshape(-1, 2)
    return v[:, 0] & v[:, 1]


def context(state: TrainState, batch: PairBatch) -> Context:
    return Context(num_pairs=jnp.maximum(pair_valid(batch).sum().astype(jnp.float32), 1.0))


def sequence_logprobs(model, batch: PairBatch, opts: StepOptions):
    """(s_N, tokens_N): float32 sequence logprob sums (nats, temperature 1) and reply lengths under `model`."""
    out, _ = score_logprobs(model, batch, 1.0, opts.logprob_chunk, precision=opts.matmul_precision)
    mask = batch.loss_mask_NxC & batch.valid_N[:, None]
    return jnp.where(mask, out.logp_BxT, 0.0).sum(-1), mask.sum(-1).astype(jnp.float32)


def pair_terms(s_N, ref_N, tokens_N, opts: StepOptions) -> dict[str, jax.Array]:
    """Per-pair float32 [P] arrays: loss, chosen / rejected implicit rewards and logprobs, accuracy (1, 1/2, 0)."""
    if opts.loss in losses.LENGTH_NORMALIZED:
        n = jnp.maximum(tokens_N, 1.0)
        s_N, ref_N = s_N / n, ref_N / n
    s, ref = s_N.reshape(-1, 2), ref_N.reshape(-1, 2)
    h = (s[:, 0] - s[:, 1]) - (ref[:, 0] - ref[:, 1])
    reward = opts.beta * (s - ref)
    acc = jnp.where(reward[:, 0] > reward[:, 1], 1.0, jnp.where(reward[:, 0] == reward[:, 1], 0.5, 0.0))
    return {"dpo/loss": losses.loss_fn(opts.loss)(h, opts.beta, opts.label_smoothing),
            "rewards/chosen": reward[:, 0], "rewards/rejected": reward[:, 1],
            "rewards/margins": reward[:, 0] - reward[:, 1], "rewards/accuracies": acc,
            "logps/chosen": s[:, 0], "logps/rejected": s[:, 1]}


def make_loss_fn(graphdef, opts: StepOptions):
    """The DPO `loss_fn(params, frozen, microbatch, context) -> (loss, metrics)` of `learn.step`."""

    def loss_fn(params, frozen, mb: PairBatch, ctx: Context):
        s_N, tokens_N = sequence_logprobs(merge_model(graphdef, params, frozen), mb, opts)
        terms = pair_terms(s_N, jax.lax.stop_gradient(mb.ref_logp_N), tokens_N, opts)
        valid = pair_valid(mb).astype(jnp.float32)
        metrics = {k: (v * valid).sum() / ctx.num_pairs for k, v in terms.items()}
        metrics["dpo/pairs"] = valid.sum()
        return metrics["dpo/loss"], metrics

    return loss_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """The pure DPO step `(state, batch) -> (state, metrics)`, one update; ValueError as `losses.check_settings`."""
    losses.check_settings(opts.loss, opts.beta, opts.label_smoothing)
    return step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings, context_fn=context)


def make_reference_fn(graphdef, opts: StepOptions):
    """Jitted `(params, frozen, batch) -> s_N`: sequence logprobs (the reference's, under the initial policy)."""

    @jax.jit
    def reference_fn(params, frozen, batch: PairBatch):
        return sequence_logprobs(merge_model(graphdef, params, frozen), batch, opts)[0]

    return reference_fn


def make_eval_fn(graphdef, opts: StepOptions):
    """Jitted `(params, frozen, batch) -> (pair_terms, valid_P)`, for held-out accuracy and margins (host-side)."""

    @jax.jit
    def eval_fn(params, frozen, batch: PairBatch):
        s_N, tokens_N = sequence_logprobs(merge_model(graphdef, params, frozen), batch, opts)
        return pair_terms(s_N, batch.ref_logp_N, tokens_N, opts), pair_valid(batch)

    return eval_fn
