"""The reward-model update on the generic step: `make_train_step(graphdef, tx, lr_schedule, opts)`.

Dimension legend: see `posttrain.types` (R rows, L width, N = 2R samples, C scored slots); P = R pairs.

The batch is DPO's `PairBatch` (`posttrain.algos.dpo.data`: row p holds prompt p once, then its chosen reply
(branch 1, sample 2p) and its rejected reply (branch 2, sample 2p + 1); `ref_logp_N` unused). Sample n's reward is
the `RewardModel`'s head at the last position of its branch in its row (`last_positions`), so the prompt's forward
and backward pass is shared by both replies. The loss is the mean of the named pair loss (`algos.rm.losses`) over
the valid pairs of the FULL batch (the denominator from `context`, once per step: microbatches sum to the
full-batch value, docs/design.md invariant 3).

Metrics (means over pairs): `rm/loss`, `rm/train_accuracy` (r_c > r_r; a tie counts 1/2), `rm/train_margin`
(r_c - r_r), `rm/chosen`, `rm/rejected` (the rewards), and `rm/pairs` (valid pairs in the batch).
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
    """Static settings of the reward-model step (hashable). loss: a name in `losses.LOSSES`; center_coef: its
    reward-centering coefficient (>= 0); num_microbatches: M (rows divide by it); matmul_precision: of the model's
    matmuls (default | high | highest)."""

    loss: str = "bradley_terry"
    center_coef: float = 0.0
    num_microbatches: int = 1
    matmul_precision: str = "default"

    @property
    def step_settings(self) -> step_lib.StepSettings:
        return step_lib.StepSettings(num_microbatches=self.num_microbatches, loss_metric="rm/loss")


class Context(NamedTuple):
    """Per-step values of the full batch: num_pairs, float32 scalar max(1, valid pairs)."""

    num_pairs: jax.Array


def context(state: TrainState, batch: RewardBatch) -> Context:
    return Context(num_pairs=jnp.maximum(pair_valid(batch).sum().astype(jnp.float32), 1.0))


def last_positions(segment_ids_RxL, branch_ids_RxL, samples_per_row: int) -> tuple[jax.Array, jax.Array]:
    """(rows_N, last_N) int32 [N]: the row of sample n (n // S) and the position of its last token: the last
    non-padding position of its branch (n % S + 1) when rows hold S > 1 samples, of the row when S = 1; 0 for an
    empty sample (a padding row)."""
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
    """The pure reward-model step `(state, batch) -> (state, metrics)`: one optimizer update (jitted by the
    learner). Raises ValueError for an unknown loss or a negative center_coef."""
    losses.check_settings(opts.loss, opts.center_coef)
    return step_lib.make_step(make_loss_fn(graphdef, opts), tx, lr_schedule, opts.step_settings, context_fn=context)


def make_eval_fn(graphdef, opts: StepOptions):
    """jitted `(params, frozen, batch) -> (terms, valid_P)`: `pair_terms` of every pair and the pairs' validity,
    for held-out accuracy and margin (aggregated on the host)."""

    @jax.jit
    def eval_fn(params, frozen, batch: RewardBatch):
        return pair_terms(sample_rewards(merge_model(graphdef, params, frozen), batch), opts), pair_valid(batch)

    return eval_fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMConfig:
    """The `rm` section: preference pairs in TRL's format and the Bradley-Terry objective.

    Attributes:
      train_path: a JSONL file of {"prompt", "chosen", "rejected"} records ("" : use `train_examples`).
      train_examples: the same records inline (tiny runs and tests); exactly one data source is set.
      eval_path: held-out pairs as a JSONL file ("" : `eval_examples`, else `eval_fraction`).
      eval_examples: held-out pairs inline.
      eval_fraction: share in [0, 1) of the training records (or, from an archive, of its prompts) held out when
        no held-out data is given.
      loss: the pair loss, one of `LOSS_NAMES` (`posttrain.algos.rm.losses`).
      center_coef: >= 0, the reward-centering coefficient: center_coef * (r_chosen + r_rejected)^2 is added to
        each pair's loss (TRL's `center_rewards_coefficient`; 0: off).
      max_prompt_len: tokens; a longer prompt keeps its last tokens.
      max_completion_len: tokens; a longer reply keeps its first tokens.
      pairs_per_step: pairs in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
      num_microbatches: gradient-accumulation microbatches.
      eval_at_start: held-out accuracy and margin before the first step.
      eval_at_end: the same after the last step.
      export: write the trained model as a transformers `AutoModelForSequenceClassification` directory in
        `<workdir>/reward_model` at the end (what `rewards.model=<workdir>` of a GRPO run loads).
      from_archive: a GRPO run's workdir, or several separated by commas (`algos.from_archive.archive_runs`): pairs
        from their archived groups (same prompt and policy version, a reply
        scored 1 chosen over one scored 0; `posttrain.algos.from_archive.dpo_pairs`). "": not used.
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
