"""The configuration of a reward-model run (`posttrain rm --config=configs/rm_*.py`): the `rm` section and its
loader.

A reward-model config file defines `get_config()` returning `default_rm_config()` edited: the sections it shares
with GRPO, SFT and DPO runs (`model`: the backbone, `mesh`, `optim`, `lora`, `checkpoint`, `train`; validated by
`load.from_config_dict`) plus `rm`, an `RMConfig`. `posttrain.recipes.rm.make_rm_plan` is the only reader of the
result. The data are DPO's preference pairs (`posttrain.algos.dpo.data`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from posttrain.config.sft import OfflineRunConfig, offline_config_from_dict

LOSS_NAMES = ("bradley_terry",)  # posttrain.algos.rm.losses.LOSSES (a test keeps them equal)


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
      from_archive: a GRPO run's workdir, or several separated by commas (`config.sft.archive_runs`): pairs
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
