"""The configuration of a DPO run (`posttrain dpo`): the `dpo` section beside the shared ones, and its loader."""
from __future__ import annotations

import dataclasses

from posttrain.algos.dpo.data import LOSS_NAMES, DPOConfig  # noqa: F401  (the dpo section)
from posttrain.config.sft import OfflineRunConfig, offline_config_from_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPORunConfig(OfflineRunConfig):
    """A validated DPO run configuration: the shared sections (the policy, also the frozen reference) and `dpo`.

    Attributes:
      dpo: the `DPOConfig`."""

    dpo: DPOConfig = DPOConfig()


def default_dpo_config():
    """The ConfigDict of every default of a DPO run (its data unset)."""
    import ml_collections

    raw = dataclasses.asdict(DPORunConfig())
    raw["train"]["workdir"] = "runs/dpo"
    return ml_collections.ConfigDict(raw)


def dpo_config_from_dict(cd) -> DPORunConfig:
    """Converts a ConfigDict (or nested dict) into a validated `DPORunConfig` (see `sft.offline_config_from_dict`)."""
    return offline_config_from_dict(cd, "dpo", DPOConfig, DPORunConfig,
                                    "a JSONL file of {prompt, chosen, rejected} records")


def to_dict(cfg: DPORunConfig) -> dict:
    return dataclasses.asdict(cfg)
