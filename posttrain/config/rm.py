"""The configuration of a reward-model run (`posttrain rm --config=configs/rm_*.py`): the `rm` section and its
loader.

A reward-model config file defines `get_config()` returning `default_rm_config()` edited: the sections it shares
with GRPO, SFT and DPO runs (`model`: the backbone, `mesh`, `optim`, `lora`, `checkpoint`, `train`; validated by
`load.from_config_dict`) plus `rm`, an `RMConfig`. `posttrain.recipes.rm.make_rm_plan` is the only reader of the
result. The data are DPO's preference pairs (`posttrain.algos.dpo.data`).
"""
from __future__ import annotations

import dataclasses

from posttrain.algos.rm.step import LOSS_NAMES, RMConfig  # noqa: F401  (the rm section)
from posttrain.config.sft import OfflineRunConfig, offline_config_from_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMRunConfig(OfflineRunConfig):
    """A validated reward-model run configuration (frozen): the shared sections (`model`: the backbone the head
    sits on) and `rm`.

    Attributes:
      rm: the `RMConfig`.
    """

    rm: RMConfig = RMConfig()


def default_rm_config():
    """An `ml_collections.ConfigDict` of every default of a reward-model run (no data: the config sets
    `rm.train_path`, `rm.train_examples` or `rm.from_archive`)."""
    import ml_collections

    raw = dataclasses.asdict(RMRunConfig())
    raw["train"]["workdir"] = "runs/rm"
    return ml_collections.ConfigDict(raw)


def rm_config_from_dict(cd) -> RMRunConfig:
    """A ConfigDict (or nested dict) -> a validated `RMRunConfig`. Raises ConfigError naming the key path for an
    unknown section or key, a wrong type, an invalid value, no training data, a missing data file, or LoRA
    (lora.rank > 0: the head trains with every weight)."""
    from posttrain.config.load import ConfigError

    cfg = offline_config_from_dict(cd, "rm", RMConfig, RMRunConfig, "a JSONL file of {prompt, chosen, rejected} "
                                   "records")
    if cfg.lora.rank:
        raise ConfigError(f"lora.rank={cfg.lora.rank}: a reward model trains its head with every weight of the "
                          "backbone; set lora.rank=0")
    return cfg


def to_dict(cfg: RMRunConfig) -> dict:
    """Plain nested dict of an RMRunConfig (JSON-serialisable; config.json and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
