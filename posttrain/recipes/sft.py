"""The SFT recipe (`posttrain sft`): plan -> policy, data, learner -> per step: batch, update, log, save."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Mapping

import jax
import numpy as np

from posttrain.algos import from_archive
from posttrain.errors import DataError
from posttrain.algos.sft import data as data_lib
from posttrain.algos.sft import packing
from posttrain.algos.sft import step as sft_step
from posttrain.checkpoints.policy import PolicySource, load_policy
from posttrain.config.sft import SFTRunConfig, to_dict
from posttrain.infra import distributed, mesh as mesh_lib
from posttrain.infra.partitioning import use_rules
from posttrain.infra.precision import PrecisionPolicy
from posttrain.learn.learner import Learner, LearnerSettings
from posttrain.learn import offline_loop
from posttrain.config.plan import offline_layout
from posttrain.learn.learner import TrainConfig
from posttrain.runs import workdir as workdir_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTPlan:
    """Every derived setting of one SFT run; code reads these, never the config.

    Attributes:
        workdir: the run's directory.
        config_dict: the config as a plain dict (config.json, checkpoint metadata).
        precision: the resolved precision policy.
        mesh_shape: resolved axis sizes (no -1).
        rules: logical-axis rules with the config's overlays.
        batch_shards: devices the batch is split over.
        policy: where the policy comes from and how it is built (PolicySource).
        data: what SFT reads (`posttrain.algos.sft.data.DataSettings`).
        step: the SFT step's options before the loaded model's MoE coefficients (`model_step`).
        moe_aux_coef: sft.moe_aux_coef (< 0: the model's own).
        learner: the update phase's settings (LearnerSettings).
        train: the config's train section.
        eval_at_start: held-out NLL and perplexity before the first step.
        eval_at_end: held-out NLL and perplexity after the last step."""

    workdir: pathlib.Path
    config_dict: dict
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]
    rules: tuple
    batch_shards: int
    policy: PolicySource
    data: data_lib.DataSettings
    step: sft_step.StepOptions
    moe_aux_coef: float
    learner: LearnerSettings
    train: TrainConfig
    eval_at_start: bool = True
    eval_at_end: bool = True

    def model_step(self, moe) -> sft_step.StepOptions:
        """The step options for the loaded model (its MoEConfig or None)."""
        return sft_step.with_moe(self.step, moe, self.moe_aux_coef)


def make_sft_plan(cfg: SFTRunConfig, *, num_devices: int | None = None, workdir: str | None = None,
                  backend: str | None = None) -> SFTPlan:
    """Derives and validates every setting of an SFT run (no I/O); ConfigError as `offline_layout`."""
    s = cfg.sft
    shape, rules, shards, precision = offline_layout(cfg, "sft.rows_per_step", s.rows_per_step, s.num_microbatches,
                                                     num_devices, backend)
    wd = pathlib.Path(workdir or cfg.train.workdir)
    config_dict = to_dict(cfg)
    t = cfg.train
    data = data_lib.DataSettings(train_path=s.train_path, eval_path=s.eval_path, train_records=s.train_examples,
                                 eval_records=s.eval_examples, eval_fraction=s.eval_fraction, seq_len=s.seq_len,
                                 rows_per_step=s.rows_per_step, packing=s.packing, seed=t.seed,
                                 from_archive=s.from_archive, min_reward=s.min_reward,
                                 max_per_prompt=s.max_per_prompt)
    step = sft_step.StepOptions(num_microbatches=s.num_microbatches, logprob_chunk=s.logprob_chunk,
                                matmul_precision=cfg.model.matmul_precision, lora_rank=cfg.lora.rank)
    learner = LearnerSettings(workdir=wd, optimizer=cfg.optim, total_steps=cfg.train.steps, lora_rank=cfg.lora.rank,
                              need_reference=False, seed=t.seed, checkpointing=cfg.checkpoint, rules=rules,
                              config_dict=config_dict)
    return SFTPlan(workdir=wd, config_dict=config_dict, precision=precision, mesh_shape=shape, rules=rules,
                   batch_shards=shards, policy=PolicySource.of(cfg.model, cfg.lora, precision, seed=cfg.train.seed), data=data, step=step,
                   moe_aux_coef=s.moe_aux_coef, learner=learner,
                   train=cfg.train,
                   eval_at_start=s.eval_at_start, eval_at_end=s.eval_at_end)


def step_builder(plan: SFTPlan):
    """The learner's `build_step`: the SFT step of `plan` for the loaded model (its MoE coefficients)."""
    return lambda graphdef, tx, lr_schedule, model_config: sft_step.make_train_step(
        graphdef, tx, lr_schedule, plan.model_step(model_config.moe))


def load_examples(d: data_lib.DataSettings, tokenizer):
    """(train examples, held-out examples, counts): from the archive of `d.from_archive`, else from the records.

    Raises FileNotFoundError for a run without an archive, DataError (one line: what is missing and how to get it)
    when no training example is left."""
    if not d.from_archive:
        return data_lib.load_datasets(d, tokenizer)
    train, held, counts = from_archive.sft_examples(from_archive.archive_table(d.from_archive), min_reward=d.min_reward,
                                                    max_per_prompt=d.max_per_prompt, max_len=d.seq_len,
                                                    eval_fraction=d.eval_fraction or from_archive.ARCHIVE_EVAL_FRACTION,
                                                    seed=d.seed)
    if not train:
        raise DataError(f"posttrain sft --from_archive={d.from_archive}: no successful reply to train on ({counts}); "
                        f"a reply counts when its reward is >= --min_reward={d.min_reward:g}: lower --min_reward, "
                        "train the run longer, or give --config with examples of your own")
    return train, held, counts


class Run:
    """The pieces of an SFT run (policy, packed rows, held-out batches, restored learner); claims the workdir first."""

    def __init__(self, plan: SFTPlan):
        workdir_lib.claim_offline(plan.workdir, "sft", plan.config_dict, SFTRunConfig)
        self.plan = plan
        self.mesh = mesh_lib.make_mesh(plan.mesh_shape)
        model_config, graphdef, weights, self.tokenizer = load_policy(plan.policy, self.mesh, plan.rules)
        d = plan.data
        self.train_examples, eval_examples, self.counts = load_examples(d, self.tokenizer)
        self.rows = packing.pack(self.train_examples, d.seq_len, d.packing)
        self.counts["sft/train_rows"] = len(self.rows)
        self.shape = packing.batch_shape(self.train_examples, self.rows, d.seq_len)  # (L, C): one train compile
        self.eval_batches = packing.eval_batches(eval_examples, d.seq_len, d.rows_per_step, self.tokenizer.pad_id,
                                                 d.packing)
        self.learner = Learner.create(plan.learner, self.mesh, model_config, graphdef, weights, step_builder(plan))
        self.learner.restore()
        workdir_lib.write_config(plan.workdir, plan.config_dict)  # restored (or new): its settings
        self._eval_fn = sft_step.make_eval_fn(self.learner.graphdef, plan.model_step(model_config.moe))

    def batch(self, step: int):
        """The host batch of `step` (`packing.step_rows`), as wide as the longest training row (`batch_shape`)."""
        d = self.plan.data
        idx = packing.step_rows(len(self.rows), d.rows_per_step, step, d.seed)
        L, C = self.shape
        return packing.make_batch(self.train_examples, [self.rows[i] for i in idx], L, self.tokenizer.pad_id,
                                  slots=C)

    def evaluate(self) -> dict[str, float]:
        """Held-out `sft/eval_loss`, `sft/ppl`, `sft/eval_tokens` of the current weights ({} without held-out data)."""
        if not self.eval_batches:
            return {}
        nll, tokens = 0.0, 0.0
        state = self.learner.state
        for b in self.eval_batches:
            placed = offline_loop.place(b, self.mesh, self.plan.rules)
            with jax.set_mesh(self.mesh):
                s, n = self._eval_fn(state.params, state.frozen, placed)
            nll, tokens = nll + float(s), tokens + float(n)
        return sft_step.perplexity(nll, tokens)

    def tokens(self, batch) -> int:
        """Non-padding tokens of a host batch."""
        return int(np.count_nonzero(batch.segment_ids_RxL))


def train(plan: SFTPlan, *, progress: bool = True) -> dict:
    """Runs (or resumes) SFT as planned; returns the summary (also in summary.json).

    Raises ValueError / FileNotFoundError for unusable data (naming the record), NonFiniteError as `grpo.train` does."""
    # a signal while the run is built is one line too; its grace is the config's
    with use_rules(plan.rules), distributed.StopRequest(plan.learner.checkpointing.stop_grace_s) as stop:
        return offline_loop.train_loop(Run(plan), name="sft", workdir=plan.workdir, train_config=plan.train,
                                  config_dict=plan.config_dict, eval_at_start=plan.eval_at_start,
                                  eval_at_end=plan.eval_at_end, progress=progress, stop=stop,
                                  bar_fields=(("loss", "sft/loss"),),
                                  on_nonfinite=lambda: "; lower optim.lr or check the data")
