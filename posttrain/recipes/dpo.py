"""The DPO recipe (`posttrain dpo`): plan -> policy, pairs, reference logprobs -> per step: batch, update, log, save.

The reference is the initial policy, its logprobs computed once and cached (docs/commands.md): no second model."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Mapping

import jax
import numpy as np

from posttrain.algos import from_archive
from posttrain.errors import DataError
from posttrain.algos.dpo import data as data_lib
from posttrain.algos.dpo import reference
from posttrain.algos.dpo import step as dpo_step
from posttrain.algos.sft.packing import step_rows
from posttrain.checkpoints.policy import PolicySource, load_policy
from posttrain.config.dpo import DPORunConfig, to_dict
from posttrain.infra import distributed, mesh as mesh_lib
from posttrain.infra.partitioning import use_rules
from posttrain.infra.precision import PrecisionPolicy
from posttrain.learn.learner import Learner, LearnerSettings
from posttrain.learn import offline_loop
from posttrain.config.plan import offline_layout
from posttrain.learn.learner import TrainConfig
from posttrain.runs import workdir as workdir_lib

CACHE_FILE = "reference_logps.parquet"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOPlan:
    """Every derived setting of one DPO run.

    Attributes:
      workdir: the run's directory.
      config_dict: the config as a plain dict (config.json, checkpoint metadata); code reads the other fields.
      precision: the resolved precision policy.
      mesh_shape: resolved mesh axis sizes (no -1).
      rules: logical-axis rules with the config's overlays.
      policy: where the policy (and so the reference) comes from.
      data: the pair data settings.
      step: the DPO step's static options.
      learner: the update phase's settings (no reference model: its logprobs are cached).
      train: steps and limits.
      reference_cache: reuse `reference_logps.parquet` while the hashes match.
      eval_at_start: held-out pair metrics before the first step.
      eval_at_end: held-out pair metrics after the last step."""

    workdir: pathlib.Path
    config_dict: dict
    precision: PrecisionPolicy
    mesh_shape: Mapping[str, int]
    rules: tuple
    policy: PolicySource
    data: data_lib.PairSettings
    step: dpo_step.StepOptions
    learner: LearnerSettings
    train: TrainConfig
    reference_cache: bool = True
    eval_at_start: bool = True
    eval_at_end: bool = True


def make_dpo_plan(cfg: DPORunConfig, *, num_devices: int | None = None, workdir: str | None = None,
                  backend: str | None = None) -> DPOPlan:
    """Derives and validates every setting of a DPO run (no I/O); ConfigError as `offline_layout`."""
    d = cfg.dpo
    shape, rules, _, precision = offline_layout(cfg, "dpo.pairs_per_step", d.pairs_per_step, d.num_microbatches,
                                                num_devices, backend)
    wd = pathlib.Path(workdir or cfg.train.workdir)
    config_dict, t = to_dict(cfg), cfg.train
    pairs = pair_settings(d, t.seed)
    step = dpo_step.StepOptions(loss=d.loss, beta=d.beta, label_smoothing=d.label_smoothing,
                                num_microbatches=d.num_microbatches, logprob_chunk=d.logprob_chunk,
                                matmul_precision=cfg.model.matmul_precision, lora_rank=cfg.lora.rank)
    learner = LearnerSettings(workdir=wd, optimizer=cfg.optim, total_steps=cfg.train.steps, lora_rank=cfg.lora.rank,
                              need_reference=False, seed=t.seed, checkpointing=cfg.checkpoint, rules=rules,
                              config_dict=config_dict)
    return DPOPlan(workdir=wd, config_dict=config_dict, precision=precision, mesh_shape=shape, rules=rules,
                   policy=PolicySource.of(cfg.model, cfg.lora, precision, seed=cfg.train.seed), data=pairs, step=step, learner=learner,
                   train=cfg.train,
                   reference_cache=d.reference_cache, eval_at_start=d.eval_at_start, eval_at_end=d.eval_at_end)


def reference_hash(source: PolicySource) -> str:
    """The sha256 hex naming the reference: the policy source's settings and each weight file's path, size and mtime."""
    files = []
    path = pathlib.Path(source.path) if getattr(source, "path", "") else None
    if path is not None and path.exists():
        for f in sorted([path] if path.is_file() else path.rglob("*")):
            if f.is_file():
                st = f.stat()
                files.append([str(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps([repr(source), files], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_pairs(d: data_lib.PairSettings, tokenizer, command: str = "dpo"):
    """(train pairs, held-out pairs): from the archive of `d.from_archive`, else from the records (`data.load_pairs`).

    `command` ("dpo" or "rm") names the command in the error. Raises FileNotFoundError for a run without an
    archive, DataError (one line: what is missing and how to get it) when no training pair is left."""
    if not d.from_archive:
        return data_lib.load_pairs(d, tokenizer)
    train, held, counts = from_archive.dpo_pairs(from_archive.archive_table(d.from_archive),
                                                 max_prompt_len=d.max_prompt_len,
                                                 max_completion_len=d.max_completion_len,
                                                 eval_fraction=d.eval_fraction or from_archive.ARCHIVE_EVAL_FRACTION,
                                                 seed=d.seed)
    if not train:
        raise DataError(f"posttrain {command} --from_archive={d.from_archive}: no training pair in the archive "
                        f"({counts}); a pair is a reply scored 1 and one scored 0 to the same prompt: train the run "
                        "longer (or on tasks it solves sometimes, rl.group_size >= 2), or give --config with "
                        "pairs of your own")
    return train, held


class Run:
    """The pieces of a DPO run (policy, pairs, reference logprobs, restored learner); claims the workdir first."""

    def __init__(self, plan: DPOPlan):
        workdir_lib.claim_offline(plan.workdir, "dpo", plan.config_dict, DPORunConfig)
        self.plan = plan
        self.mesh = mesh_lib.make_mesh(plan.mesh_shape)
        model_config, graphdef, weights, self.tokenizer = load_policy(plan.policy, self.mesh, plan.rules)
        self.train_pairs, self.eval_pairs = load_pairs(plan.data, self.tokenizer)
        self.regions = data_lib.regions(self.train_pairs + self.eval_pairs)
        build = lambda g, tx, lr, mc: dpo_step.make_train_step(g, tx, lr, plan.step)
        self.learner = Learner.create(plan.learner, self.mesh, model_config, graphdef, weights, build,
                                      batch_type=data_lib.PairBatch)
        self.ref = self._reference_logps()  # of the initial weights: before any restore
        self.learner.restore()
        workdir_lib.write_config(plan.workdir, plan.config_dict)  # restored (or new): its settings
        self._eval_fn = dpo_step.make_eval_fn(self.learner.graphdef, plan.step)
        self.counts = {"dpo/train_pairs": len(self.train_pairs), "dpo/eval_pairs": len(self.eval_pairs),
                       "dpo/truncated": sum(p.truncated for p in self.train_pairs + self.eval_pairs),
                       "dpo/reference_cached": self.reference_from_cache}

    def _batches(self, pairs, ref_logps=None):
        P = self.plan.data.pairs_per_step
        for i in range(0, len(pairs), P):
            chunk = pairs[i:i + P]
            ref = None if ref_logps is None else reference.as_samples([p.pair_id for p in chunk], ref_logps)
            yield chunk, data_lib.make_batch(chunk, *self.regions, self.tokenizer.pad_id, P, ref)

    def _reference_logps(self) -> dict[str, tuple[float, float]]:
        pairs = self.train_pairs + self.eval_pairs
        path = self.plan.workdir / CACHE_FILE
        hashes = (reference_hash(self.plan.policy), data_lib.data_hash(pairs))
        cached = reference.read(path, *hashes) if self.plan.reference_cache else None
        self.reference_from_cache = cached is not None
        if cached is not None:
            return cached
        fn = dpo_step.make_reference_fn(self.learner.graphdef, self.plan.step)
        state, out = self.learner.state, {}
        for chunk, batch in self._batches(pairs):
            with jax.set_mesh(self.mesh):
                s_N = np.asarray(jax.device_get(fn(state.params, state.frozen,
                                                   offline_loop.place(batch, self.mesh, self.plan.rules))))
            out.update({p.pair_id: (float(s_N[2 * k]), float(s_N[2 * k + 1])) for k, p in enumerate(chunk)})
        if self.plan.reference_cache:
            reference.write(path, out, *hashes)
        return out

    def batch(self, step: int) -> data_lib.PairBatch:
        """The host batch of `step`: pairs drawn epoch by epoch in a seeded order (a function of the step)."""
        d = self.plan.data
        chunk = [self.train_pairs[i] for i in step_rows(len(self.train_pairs), d.pairs_per_step, step, d.seed)]
        ref = reference.as_samples([p.pair_id for p in chunk], self.ref)
        return data_lib.make_batch(chunk, *self.regions, self.tokenizer.pad_id, d.pairs_per_step, ref)

    def evaluate(self) -> dict[str, float]:
        """Held-out pair accuracy (ties 1/2) with its 95% bootstrap interval and the mean margin ({} without pairs)."""
        if not self.eval_pairs:
            return {}
        acc, margin = [], []
        state = self.learner.state
        for _, batch in self._batches(self.eval_pairs, self.ref):
            with jax.set_mesh(self.mesh):
                terms, valid = self._eval_fn(state.params, state.frozen,
                                             offline_loop.place(batch, self.mesh, self.plan.rules))
            terms, valid = jax.device_get((terms, valid))
            acc.extend(np.asarray(terms["rewards/accuracies"])[valid])
            margin.extend(np.asarray(terms["rewards/margins"])[valid])
        return {"dpo/eval_accuracy": float(np.mean(acc)), **accuracy_interval(np.asarray(acc)),
                "dpo/eval_margin": float(np.mean(margin)), "dpo/eval_pairs": float(len(acc))}

    def tokens(self, batch) -> int:
        return int(np.count_nonzero(batch.segment_ids_RxL))


def pair_settings(section, seed: int) -> data_lib.PairSettings:
    """The pair data's settings from a preference-pair config section (`dpo` or `rm`: the same data fields)."""
    return data_lib.PairSettings(train_path=section.train_path, eval_path=section.eval_path,
                                 train_records=section.train_examples, eval_records=section.eval_examples,
                                 eval_fraction=section.eval_fraction, max_prompt_len=section.max_prompt_len,
                                 max_completion_len=section.max_completion_len,
                                 pairs_per_step=section.pairs_per_step, seed=seed, from_archive=section.from_archive)


def accuracy_interval(acc_P: np.ndarray, confidence: float = 0.95, seed: int = 0) -> dict[str, float]:
    """dpo/eval_accuracy_{lo,hi}: the percentile-bootstrap interval (fixed seed) of the mean per-pair accuracy."""
    lo, hi = offline_loop.bootstrap_interval(np.asarray(acc_P, float), confidence, seed)
    return {"dpo/eval_accuracy_lo": lo, "dpo/eval_accuracy_hi": hi}


def train(plan: DPOPlan, *, progress: bool = True) -> dict:
    """Runs (or resumes) DPO as planned; returns the summary (also in summary.json).

    Raises ValueError / TypeError for unusable pairs (naming the record), NonFiniteError as `grpo.train` does."""
    # a signal while the run is built is one line too; its grace is the config's
    with use_rules(plan.rules), distributed.StopRequest(plan.learner.checkpointing.stop_grace_s) as stop:
        return offline_loop.train_loop(Run(plan), name="dpo", workdir=plan.workdir, train_config=plan.train,
                                  config_dict=plan.config_dict, eval_at_start=plan.eval_at_start,
                                  eval_at_end=plan.eval_at_end, progress=progress, stop=stop,
                                  bar_fields=(("loss", "dpo/loss"), ("acc", "rewards/accuracies")),
                                  on_nonfinite=lambda: "; lower optim.lr or beta")
