"""The configuration of an SFT run (`posttrain sft`), and the sections every offline run shares with a GRPO run."""
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
    """The sections an offline run (SFT, DPO, RM) shares with a GRPO run's `schema.Config` (`SHARED_SECTIONS`).

    Attributes:
        model: the policy's source and run settings (ModelRunConfig).
        mesh: the device mesh (MeshConfig).
        optim: the optimizer and learning-rate schedule (OptimConfig).
        lora: low-rank adapters (LoRAConfig; rank 0: none).
        checkpoint: checkpoint saving (CheckpointConfig).
        train: steps, seed, workdir and stopping rules (TrainConfig)."""

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
        sft: the SFT data and step (SFTConfig)."""

    sft: SFTConfig = SFTConfig()


def default_sft_config():
    """The ConfigDict of every default of an SFT run (its data unset)."""
    import ml_collections

    raw = dataclasses.asdict(SFTRunConfig())
    raw["train"]["workdir"] = "runs/sft"
    return ml_collections.ConfigDict(raw)


def sft_config_from_dict(cd) -> SFTRunConfig:
    """Converts a ConfigDict (or nested dict) into a validated `SFTRunConfig` (see `offline_config_from_dict`)."""
    return offline_config_from_dict(cd, "sft", SFTConfig, SFTRunConfig, "a JSONL file of TRL-format records")


def offline_config_from_dict(cd, name: str, section_cls, run_cls, data_kind: str):
    """Converts a ConfigDict (or nested dict) into `run_cls`: the shared sections plus its own section `name`.

    Raises ConfigError naming the key path for an unknown section or key, a wrong type, an invalid value, no training
    data, a missing data file (described as `data_kind`) or a bad `from_archive`."""
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
    """Checks that each run of `runs` is a distinct directory with an episode archive; else ConfigError naming `key`."""
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
    return dataclasses.asdict(cfg)
