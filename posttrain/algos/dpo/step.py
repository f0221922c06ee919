"""The DPO update on the generic step: `make_train_step(graphdef, tx, lr_schedule, opts) -> step(state, batch)`.

Dimension legend: see `posttrain.types` (R rows, L width, N = 2R samples, C scored slots); P = R pairs.

Per sample n the sequence logprob is s_n = sum_c mask[n, c] log pi(targets[n, c] | ...) (float32 nats, from
`learn.logprobs.score_logprobs` at temperature 1, chunked through the unembedding), or its per-token mean for a
length-normalized loss (IPO). Pair p's log-ratio difference is h_p = (s_2p - s_2p+1) - (ref_2p - ref_2p+1) with the
reference's sequence logprobs `ref_logp_N` carried by the `PairBatch` (computed once, before training, by
`make_reference_fn` on the initial policy), so no reference model is held during training. The loss is the mean
of the named preference loss (`algos.dpo.losses`) over the valid pairs of the FULL batch: its denominator comes
from `context` once per step, so microbatches sum to the full-batch value (docs/design.md invariant 3).

Metrics (TRL's names, means over pairs): `dpo/loss`, `rewards/chosen`, `rewards/rejected` (beta (s - ref) of each
reply), `rewards/margins` (their difference), `rewards/accuracies` (chosen > rejected, a tie counts 1/2),
`logps/chosen`, `logps/rejected` (s of each reply), and `dpo/pairs` (valid pairs in the batch).
MoE auxiliary losses are not added (a dense-model loss).
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
    """Static settings of the DPO step (hashable). loss: a name in `losses.LOSSES`; beta, label_smoothing: its
    parameters; num_microbatches: M (rows divide by it); logprob_chunk: slots per unembedding chunk;
    matmul_precision: of the logprob matmuls; lora_rank: adapters only when > 0."""

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
    """Per-step values of the full batch: num_pairs, float32 scalar max(1, valid pairs)."""

    num_pairs: jax.Array


def pair_valid(batch: PairBatch) -> jax.Array:
    """bool [P]: pairs whose two replies are both valid (padding rows are not)."""
    v = batch.valid_N.reshape(-1, 2)
    return v[:, 0] & v[:, 1]


def context(state: TrainState, batch: PairBatch) -> Context:
    return Context(num_pairs=jnp.maximum(pair_valid(batch).sum().astype(jnp.float32), 1.0))


def sequence_logprobs(model, batch: PairBatch, opts: StepOptions):
    """(s_N float32 sequence logprob sums (nats), tokens_N float32 reply lengths) under `model`."""
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
    """The DPO `loss_fn(params, frozen, microbatch, context) -> (loss, metrics)` of `learn.step` (module doc)."""

    def loss_fn(params, frozen, mb: PairBatch, ctx: Context):
        s_N, tokens_N = sequence_logprobs(merge_model(graphdef, params, frozen), mb, opts)
        terms = pair_terms(s_N, jax.lax.stop_gradient(mb.ref_logp_N), tokens_N, opts)
        valid = pair_valid(mb).astype(jnp.float32)
        metrics = {k: (v * valid).sum() / ctx.num_pairs for k, v in terms.items()}
        metrics["dpo/pairs"] = valid.sum()
        return metrics["dpo/loss"], metrics

    return loss_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """The pure DPO step `(state, batch) -> (state, metrics)`: one optimizer update (jitted by the learner).
    Raises ValueError (at trace time) for an unknown loss or invalid beta / label smoothing."""
    losses.check_settings(opts.loss, opts.beta, opts.label_smoothing)
    return step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings, context_fn=context)


def make_reference_fn(graphdef, opts: StepOptions):
    """jitted `(params, frozen, batch) -> s_N`: float32 [N] sequence logprob sums of `batch`'s replies under the
    given weights (no gradient): the reference logprobs, computed once on the initial policy."""

    @jax.jit
    def reference_fn(params, frozen, batch: PairBatch):
        return sequence_logprobs(merge_model(graphdef, params, frozen), batch, opts)[0]

    return reference_fn


def make_eval_fn(graphdef, opts: StepOptions):
    """jitted `(params, frozen, batch) -> (terms, valid_P)`: `pair_terms` of every pair under the given weights
    and the pairs' validity, for held-out pair accuracy and margins (aggregated on the host)."""

    @jax.jit
    def eval_fn(params, frozen, batch: PairBatch):
        s_N, tokens_N = sequence_logprobs(merge_model(graphdef, params, frozen), batch, opts)
        return pair_terms(s_N, batch.ref_logp_N, tokens_N, opts), pair_valid(batch)

    return eval_fn
