"""The reward-model update on the generic step: `make_train_step(graphdef, tx, lr_schedule, opts)`, and `RMConfig`.

Shapes: the legend in `posttrain.types`. The batch is DPO's `PairBatch`; notes: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from posttrain.algos.dpo.data import PairBatch
from posttrain.algos.dpo.step import pair_valid
from posttrain.algos.rm import losses
from posttrain.learn import step as step_lib
from posttrain.learn.state import merge_model
from posttrain.types import TrainState

LOSS_NAMES = tuple(losses.LOSSES)  # `rm.loss`

RewardBatch = PairBatch  # the reward model trains on DPO's pair batches (no reference logprobs)


class StepOptions(NamedTuple):
    """Static settings of the reward-model step (hashable): a `losses.LOSSES` name, its center_coef, precision."""

    loss: str = "bradley_terry"
    center_coef: float = 0.0
    num_microbatches: int = 1
    matmul_precision: str = "default"

    @property
    def step_settings(self) -> step_lib.StepSettings:
        return step_lib.StepSettings(num_microbatches=self.num_microbatches, loss_metric="rm/loss")


class Context(NamedTuple):
    """Full-batch values of a step: num_pairs, float32 max(1, valid pairs)."""

    num_pairs: jax.Array


def context(state: TrainState, batch: RewardBatch) -> Context:
    return Context(num_pairs=jnp.maximum(pair_valid(batch).sum().astype(jnp.float32), 1.0))


def last_positions(segment_ids_RxL, branch_ids_RxL, samples_per_row: int) -> tuple[jax.Array, jax.Array]:
    """(rows_N, last_N) int32: each sample's row and the last non-padding position of its branch (0 when empty)."""
    R, L = segment_ids_RxL.shape
    idx_L = jnp.arange(L, dtype=jnp.int32)
    real_RxL = segment_ids_RxL != 0
    if samples_per_row == 1:
        mine_RxSxL = real_RxL[:, None, :]
    else:
        branches_S = jnp.arange(1, samples_per_row + 1, dtype=jnp.int32)
        mine_RxSxL = real_RxL[:, None, :] & (branch_ids_RxL[:, None, :] == branches_S[None, :, None])
    last_RxS = jnp.max(jnp.where(mine_RxSxL, idx_L, -1), axis=-1)
    rows_N = jnp.repeat(jnp.arange(R, dtype=jnp.int32), samples_per_row)
    return rows_N, jnp.maximum(last_RxS.reshape(-1), 0)


def sample_rewards(model, batch: RewardBatch) -> jax.Array:
    """float32 [N]: every sample's reward under the `RewardModel` `model`."""
    rows_N, last_N = last_positions(batch.segment_ids_RxL, batch.branch_ids_RxL, batch.samples_per_row)
    return model(batch.tokens_RxL, batch.positions_RxL, batch.segment_ids_RxL, batch.branch_ids_RxL, rows_N, last_N)


def pair_terms(r_N, opts: StepOptions) -> dict[str, jax.Array]:
    """Per-pair float32 [P] arrays: loss, accuracy (1, 1/2 for a tie, 0), margin, chosen and rejected rewards."""
    r = r_N.reshape(-1, 2)
    rc, rr = r[:, 0], r[:, 1]
    acc = jnp.where(rc > rr, 1.0, jnp.where(rc == rr, 0.5, 0.0))
    return {"rm/loss": losses.loss_fn(opts.loss)(rc, rr, opts.center_coef), "rm/train_accuracy": acc,
            "rm/train_margin": rc - rr, "rm/chosen": rc, "rm/rejected": rr}


def make_loss_fn(graphdef, opts: StepOptions):
    """The reward model's `loss_fn(params, frozen, microbatch, context) -> (loss, metrics)` of `learn.step`."""

    def loss_fn(params, frozen, mb: RewardBatch, ctx: Context):
        terms = pair_terms(sample_rewards(merge_model(graphdef, params, frozen), mb), opts)
        valid = pair_valid(mb).astype(jnp.float32)
        metrics = {k: (v * valid).sum() / ctx.num_pairs for k, v in terms.items()}
        metrics["rm/pairs"] = valid.sum()
        return metrics["rm/loss"], metrics

    return loss_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """The pure reward-model step `(state, batch) -> (state, metrics)`, one update; ValueError as `check_settings`."""
    losses.check_settings(opts.loss, opts.center_coef)
    return step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings, context_fn=context)


def make_eval_fn(graphdef, opts: StepOptions):
    """Jitted `(params, frozen, batch) -> (pair_terms, valid_P)`, for held-out accuracy and margin (host-side)."""

    @jax.jit
    def eval_fn(params, frozen, batch: RewardBatch):
        return pair_terms(sample_rewards(merge_model(graphdef, params, frozen), batch), opts), pair_valid(batch)

    return eval_fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMConfig:
    """The `rm` section: preference pairs in TRL's format and the Bradley-Terry objective.

    Attributes:
      train_path: a JSONL file of {"prompt", "chosen", "rejected"} records ("": `train_examples`).
      train_examples: the same records inline (tiny runs and tests); at most one data source is set.
      eval_path: held-out pairs as a JSONL file ("": `eval_examples`, else `eval_fraction`).
      eval_examples: held-out pairs inline.
      eval_fraction: share in [0, 1) of the training records (from an archive: its prompts, 0 meaning
            `from_archive.ARCHIVE_EVAL_FRACTION`, 0.1) held out.
      loss: one of `LOSS_NAMES`.
      center_coef: >= 0, the reward-centering coefficient (TRL's `center_rewards_coefficient`; 0: off).
      max_prompt_len: tokens; a longer prompt keeps its last tokens.
      max_completion_len: tokens; a longer reply keeps its first tokens.
      pairs_per_step: pairs in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
      num_microbatches: gradient-accumulation microbatches.
      eval_at_start: held-out accuracy and margin before the first step.
      eval_at_end: the same after the last step.
      export: write `<workdir>/reward_model` (a transformers sequence classifier, what `rewards.model` loads).
      from_archive: GRPO run workdirs, comma-separated: pairs from their archived groups ("": not used).
    """

    train_path: str = ""
    train_examples: tuple[Mapping[str, Any], ...] = ()
    eval_path: str = ""
    eval_examples: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    loss: str = "bradley_terry"
    center_coef: float = 0.0
    max_prompt_len: int = 256
    max_completion_len: int = 256
    pairs_per_step: int = 8
    num_microbatches: int = 1
    eval_at_start: bool = True
    eval_at_end: bool = True
    export: bool = True
    from_archive: str = ""

    def __post_init__(self):
        s = self
        checks = {f"loss (one of {LOSS_NAMES})": s.loss in LOSS_NAMES,
                  "center_coef (a finite number >= 0)": isinstance(s.center_coef, (int, float)) and
                  math.isfinite(s.center_coef) and s.center_coef >= 0,
                  "max_prompt_len (>= 1)": s.max_prompt_len >= 1, "max_completion_len (>= 1)": s.max_completion_len >= 1,
                  "pairs_per_step (>= 1)": s.pairs_per_step >= 1, "num_microbatches (>= 1)": s.num_microbatches >= 1,
                  "eval_fraction (in [0, 1))": 0.0 <= s.eval_fraction < 1.0,
                  "train_path / train_examples / from_archive (at most one)":
                      sum(map(bool, (s.train_path, s.train_examples, s.from_archive))) <= 1,
                  "eval_path / eval_examples (at most one)": not (s.eval_path and s.eval_examples)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            shown = {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_examples")}
            raise ValueError(f"invalid {', '.join(bad)} in rm: {shown}")
