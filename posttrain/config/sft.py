"""The configuration of an SFT run (`posttrain sft --config=configs/sft_*.py`): the `sft` section and its loader.

An SFT config file defines `get_config()` returning `default_sft_config()` edited: the sections it shares with a
GRPO run (`model`, `mesh`, `optim`, `lora`, `checkpoint`, `train`: the same dataclasses of `schema.py`, validated by
the same loader, `load.from_config_dict`, so every rule about them lives in one place) plus `sft`, an `SFTConfig`.
`posttrain.recipes.sft.make_sft_plan` is the only reader of the result.
"""
from __future__ import annotations

import dataclasses
import os

from posttrain.algos.from_archive import archive_runs
from posttrain.algos.sft.data import SFTConfig
from posttrain.config.load import ConfigError, convert_section
from posttrain.config.schema import CheckpointConfig, LoRAConfig, MeshConfig, ModelRunConfig, OptimConfig, TrainConfig

SHARED_SECTIONS = ("model", "mesh", "optim", "lora", "checkpoint", "train")


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
    cfg = convert_section(run_cls, raw, "")
    own = getattr(cfg, name)
    if own.from_archive:
        check_archive(own.from_archive, f"{name}.from_archive")
    elif not (own.train_path or own.train_examples):
        raise ConfigError(f"{name}: no training data: set {name}.train_path ({data_kind}), {name}.train_examples "
                          f"or {name}.from_archive (a GRPO run's workdir)")
    for key in ("train_path", "eval_path"):
        path = getattr(own, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{name}.{key}={path!r}: no such file ({data_kind})")
    return cfg


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
