"""The configuration of an SFT run (`posttrain sft --config=configs/sft_*.py`): the `sft` section and its loader.

An SFT config file defines `get_config()` returning `default_sft_config()` edited: the sections it shares with a
GRPO run (`model`, `mesh`, `optim`, `lora`, `checkpoint`, `train`: the same dataclasses of `schema.py`, validated by
the same loader, `load.from_config_dict`, so every rule about them lives in one place) plus `sft`, an `SFTConfig`.
`posttrain.recipes.sft.make_sft_plan` is the only reader of the result.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from posttrain.config.load import ConfigError, convert_section, from_config_dict
from posttrain.config.schema import CheckpointConfig, LoRAConfig, MeshConfig, ModelRunConfig, OptimConfig, TrainConfig

SHARED_SECTIONS = ("model", "mesh", "optim", "lora", "checkpoint", "train")


def offline_checks(section) -> dict[str, bool]:
    """{what must hold: whether it does} for the fields every offline section has (SFTConfig, DPOConfig)."""
    s = section
    return {"num_microbatches (>= 1)": s.num_microbatches >= 1, "logprob_chunk (>= 1)": s.logprob_chunk >= 1,
            "eval_fraction (in [0, 1))": 0.0 <= s.eval_fraction < 1.0,
            "train_path / train_examples / from_archive (at most one)":
                sum(map(bool, (s.train_path, s.train_examples, s.from_archive))) <= 1,
            "eval_path / eval_examples (at most one)": not (s.eval_path and s.eval_examples)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The `sft` section. Data in TRL's formats (`posttrain.algos.sft.data`): `train_path` or `train_examples`,
    exactly one of them; held-out data likewise from `eval_path` / `eval_examples`, or else the `eval_fraction` of
    the training records.

    Attributes:
        train_path: a JSONL file of training records ("": none).
        train_examples: the training records inline (for tiny runs and tests).
        eval_path: a JSONL file of held-out records ("": none).
        eval_examples: the held-out records inline.
        eval_fraction: share of the training records held out when no eval data is given (in [0, 1)).
        seq_len: the longest row in tokens (conversations longer than it are cut; >= 2). A run's batches are as
            wide as its longest packed row, rounded up to 16 (`algos.sft.packing.batch_shape`), not seq_len.
        rows_per_step: rows in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
        packing: several conversations per row (best-fit decreasing, segment ids) or one per row.
        num_microbatches: gradient-accumulation microbatches.
        logprob_chunk: slots per unembedding chunk.
        moe_aux_coef: MoE load-balance coefficient (< 0: the model's own).
        eval_at_start: held-out NLL and perplexity before the first step.
        eval_at_end: held-out NLL and perplexity after the last step.
        from_archive: a GRPO run's workdir, or several separated by commas (`config.sft.archive_runs`): train
            on their archived successful episodes instead of train_path /
            train_examples (rejection-sampling fine-tuning, `posttrain.algos.from_archive.sft_examples`; held out:
            eval_fraction of its prompts). "": not used.
        min_reward: with from_archive, an episode is successful when its reward is >= this (and its status ok).
        max_per_prompt: with from_archive, at most this many distinct successful replies per prompt (>= 1).
    """

    train_path: str = ""
    train_examples: tuple[Mapping[str, Any], ...] = ()
    eval_path: str = ""
    eval_examples: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    seq_len: int = 512
    rows_per_step: int = 8
    packing: bool = True
    num_microbatches: int = 1
    logprob_chunk: int = 256
    moe_aux_coef: float = -1.0
    eval_at_start: bool = True
    eval_at_end: bool = True
    from_archive: str = ""
    min_reward: float = 1.0
    max_per_prompt: int = 1

    def __post_init__(self):
        checks = {"seq_len (>= 2)": self.seq_len >= 2, "rows_per_step (>= 1)": self.rows_per_step >= 1,
                  "max_per_prompt (>= 1)": self.max_per_prompt >= 1,
                  **offline_checks(self)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid {', '.join(bad)} in sft: seq_len={self.seq_len}, rows_per_step="
                             f"{self.rows_per_step}, num_microbatches={self.num_microbatches}, logprob_chunk="
                             f"{self.logprob_chunk}, eval_fraction={self.eval_fraction}, train_path="
                             f"{self.train_path!r}, train_examples: {len(self.train_examples)}, eval_path="
                             f"{self.eval_path!r}, eval_examples: {len(self.eval_examples)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineRunConfig:
    """The sections an offline run (SFT, DPO) shares with a GRPO run's `schema.Config` (`SHARED_SECTIONS`).

    Attributes:
        model: the policy's source and run settings (`schema.ModelRunConfig`).
        mesh: the device mesh (`schema.MeshConfig`).
        optim: the optimizer and learning-rate schedule (`schema.OptimConfig`).
        lora: low-rank adapters (`LoRAConfig`; rank 0: none).
        checkpoint: checkpoint saving (`schema.CheckpointConfig`).
        train: steps, seed, workdir and stopping rules (`schema.TrainConfig`).
    """

    model: ModelRunConfig = ModelRunConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoRAConfig = LoRAConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    train: TrainConfig = TrainConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTRunConfig(OfflineRunConfig):
    """A validated SFT run configuration (frozen): the shared sections and `sft`.

    Attributes:
        sft: the SFT data and step (SFTConfig).
    """

    sft: SFTConfig = SFTConfig()


def default_sft_config():
    """An `ml_collections.ConfigDict` of every default of an SFT run (no training data: the config sets
    `sft.train_path` or `sft.train_examples`)."""
    import ml_collections

    raw = dataclasses.asdict(SFTRunConfig())
    raw["train"]["workdir"] = "runs/sft"
    return ml_collections.ConfigDict(raw)


def sft_config_from_dict(cd) -> SFTRunConfig:
    """A ConfigDict (or nested dict) -> a validated `SFTRunConfig`.

    Raises ConfigError naming the key path for an unknown section or key, a wrong type, an out-of-range or
    invalid value (the shared sections by `load.from_config_dict`'s rules), no training data or a missing data
    file."""
    return offline_config_from_dict(cd, "sft", SFTConfig, SFTRunConfig, "a JSONL file of TRL-format records")


def offline_config_from_dict(cd, name: str, section_cls, run_cls, data_kind: str):
    """A ConfigDict (or nested dict) -> `run_cls(<SHARED_SECTIONS>, <name>=section_cls)`: the loader of every
    config whose own section `name` reads data from `train_path` / `train_examples` and `eval_path` (SFT, DPO).
    Raises ConfigError as `sft_config_from_dict` documents; `data_kind` describes a data file in its messages."""
    raw = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
    unknown = sorted(set(raw) - set(SHARED_SECTIONS) - {name})
    if unknown:
        raise ConfigError(f"unknown {name.upper()} config section(s) {unknown}; valid: "
                          f"{sorted(SHARED_SECTIONS + (name,))}")
    # the shared sections go through the run config's own loader (a placeholder env section satisfies its
    # env.train check, which an offline run has no use for); the own section through the same conversion
    shared = from_config_dict({**{k: raw[k] for k in SHARED_SECTIONS if k in raw},
                               "env": {"train": {name: {"id": name}}}})
    own = convert_section(section_cls, raw.get(name, {}), name)
    if own.from_archive:
        check_archive(own.from_archive, f"{name}.from_archive")
    elif not (own.train_path or own.train_examples):
        raise ConfigError(f"{name}: no training data: set {name}.train_path ({data_kind}), {name}.train_examples "
                          f"or {name}.from_archive (a GRPO run's workdir)")
    for key in ("train_path", "eval_path"):
        path = getattr(own, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{name}.{key}={path!r}: no such file ({data_kind})")
    return run_cls(**{k: getattr(shared, k) for k in SHARED_SECTIONS}, **{name: own})


def archive_runs(spec: str) -> list[str]:
    """The run directories of a `from_archive` value: one workdir, or several separated by commas (e.g. the seeds
    of one config: "runs/s0,runs/s1,runs/s2"), in order, blanks dropped."""
    return [r.strip() for r in spec.split(",") if r.strip()]


def check_archive(runs: str, key: str) -> None:
    """Raises ConfigError naming `key` and the run when a run of `runs` (`archive_runs`) is not a directory
    holding an episode archive (`<run>/archive/step_*.parquet`, `posttrain.scheduling.archive`), or when two of them
    are one directory."""
    import glob

    seen = set()
    for run in archive_runs(runs):
        if not os.path.isdir(run):
            raise ConfigError(f"{key}={runs!r}: {run!r}: no such run directory")
        if not glob.glob(os.path.join(run, "archive", "step_*.parquet")):
            raise ConfigError(f"{key}={runs!r}: {run!r} has no episode archive ({os.path.join(run, 'archive')} "
                              "holds no step_*.parquet file; GRPO runs write one per step)")
        if os.path.realpath(run) in seen:
            raise ConfigError(f"{key}={runs!r}: {run!r} is named twice")
        seen.add(os.path.realpath(run))


def to_dict(cfg: SFTRunConfig) -> dict:
    """Plain nested dict of an SFTRunConfig (JSON-serialisable; config.json and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
