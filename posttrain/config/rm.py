"""The configuration of a reward-model run (`posttrain rm`): the `rm` section beside the shared ones, and its loader."""
from __future__ import annotations

import dataclasses

from posttrain.algos.rm.step import LOSS_NAMES, RMConfig  # noqa: F401  (the rm section)
from posttrain.config.sft import OfflineRunConfig, offline_config_from_dict
from posttrain.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMRunConfig(OfflineRunConfig):
    """A validated reward-model run configuration: the shared sections (`model`: the backbone) and `rm`.

    Attributes:
      rm: the `RMConfig`."""

    rm: RMConfig = RMConfig()


def default_rm_config():
    """The ConfigDict of every default of a reward-model run (its data unset)."""
    import ml_collections

    raw = dataclasses.asdict(RMRunConfig())
    raw["train"]["workdir"] = "runs/rm"
    return ml_collections.ConfigDict(raw)


def rm_config_from_dict(cd) -> RMRunConfig:
    """Converts a ConfigDict (or nested dict) into a validated `RMRunConfig`.

    Raises ConfigError as `sft.offline_config_from_dict`, and for LoRA (lora.rank > 0: the head trains every weight)."""
    cfg = offline_config_from_dict(cd, "rm", RMConfig, RMRunConfig, "a JSONL file of {prompt, chosen, rejected} "
                                   "records")
    if cfg.lora.rank:
        raise ConfigError(f"lora.rank={cfg.lora.rank}: a reward model trains its head with every weight of the "
                          "backbone; set lora.rank=0")
    return cfg


def to_dict(cfg: RMRunConfig) -> dict:
    return dataclasses.asdict(cfg)
