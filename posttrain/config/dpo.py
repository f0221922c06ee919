"""The configuration of a DPO run (`posttrain dpo --config=configs/dpo_*.py`): the `dpo` section and its loader.

A DPO config file defines `get_config()` returning `default_dpo_config()` edited: the sections it shares with GRPO
and SFT runs (`model`, `mesh`, `optim`, `lora`, `checkpoint`, `train`; validated by `load.from_config_dict`) plus
`dpo`, a `DPOConfig`. `posttrain.recipes.dpo.make_dpo_plan` is the only reader of the result.
"""
from __future__ import annotations

import dataclasses

from posttrain.algos.dpo.data import LOSS_NAMES, DPOConfig  # noqa: F401  (the dpo section)
from posttrain.config.sft import OfflineRunConfig, offline_config_from_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPORunConfig(OfflineRunConfig):
    """A validated DPO run configuration (frozen): the shared sections (the policy's, which is also the reference:
    the same weights, frozen at the start) and `dpo`.

    Attributes:
      dpo: the `DPOConfig`.
    """

    dpo: DPOConfig = DPOConfig()


def default_dpo_config():
    """An `ml_collections.ConfigDict` of every default of a DPO run (no data: the config sets `dpo.train_path` or
    `dpo.train_examples`)."""
    import ml_collections

    raw = dataclasses.asdict(DPORunConfig())
    raw["train"]["workdir"] = "runs/dpo"
    return ml_collections.ConfigDict(raw)


def dpo_config_from_dict(cd) -> DPORunConfig:
    """A ConfigDict (or nested dict) -> a validated `DPORunConfig`. Raises ConfigError naming the key path for an
    unknown section or key, a wrong type, an invalid value, no training data or a missing data file."""
    return offline_config_from_dict(cd, "dpo", DPOConfig, DPORunConfig,
                                    "a JSONL file of {prompt, chosen, rejected} records")


def to_dict(cfg: DPORunConfig) -> dict:
    """Plain nested dict of a DPORunConfig (JSON-serialisable; config.json and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
