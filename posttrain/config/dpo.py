"""The configuration of a DPO run (`posttrain dpo --config=configs/dpo_*.py`): the `dpo` section and its loader.

A DPO config file defines `get_config()` returning `default_dpo_config()` edited: the sections it shares with GRPO
and SFT runs (`model`, `mesh`, `optim`, `lora`, `checkpoint`, `train`; validated by `load.from_config_dict`) plus
`dpo`, a `DPOConfig`. `posttrain.recipes.dpo.make_dpo_plan` is the only reader of the result.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from posttrain.config.sft import OfflineRunConfig, offline_checks, offline_config_from_dict

LOSS_NAMES = ("sigmoid", "ipo", "hinge")  # posttrain.algos.dpo.losses.LOSSES (a test keeps them equal)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """The `dpo` section: preference pairs in TRL's format (`posttrain.algos.dpo.data`).

    Attributes:
      train_path: a JSONL file of {"prompt", "chosen", "rejected"} records ("" : use `train_examples`).
      train_examples: the same records inline (tiny runs and tests); exactly one of the two is set.
      eval_path: held-out pairs as a JSONL file ("" : `eval_examples`, else `eval_fraction`).
      eval_examples: held-out pairs inline.
      eval_fraction: share in [0, 1) of the training records held out when no held-out data is given.
      loss: the preference loss, one of `LOSS_NAMES` (sigmoid: DPO; ipo: IPO; hinge: SLiC).
      beta: > 0, the implicit KL strength (TRL's default 0.1).
      label_smoothing: in [0, 0.5), conservative DPO's label-flip probability (sigmoid loss only).
      max_prompt_len: tokens; a longer prompt keeps its last tokens.
      max_completion_len: tokens; a longer reply keeps its first tokens.
      pairs_per_step: pairs in a step's batch (a multiple of num_microbatches x the mesh's batch shards).
      num_microbatches: gradient-accumulation microbatches.
      logprob_chunk: scored slots per unembedding chunk.
      reference_cache: store the reference logprobs in `<workdir>/reference_logps.parquet` and reuse them while
        the model and data hashes match (False: recompute at every start).
      eval_at_start: held-out pair accuracy and margins before the first step.
      eval_at_end: the same after the last step.
      from_archive: a GRPO run's workdir, or several separated by commas (`config.sft.archive_runs`): pairs
        from their archived groups instead of train_path / train_examples
        (same prompt and policy version, a reply scored 1 chosen over one scored 0;
        `posttrain.algos.from_archive.dpo_pairs`; held out: eval_fraction of its prompts). "": not used.
    """

    train_path: str = ""
    train_examples: tuple[Mapping[str, Any], ...] = ()
    eval_path: str = ""
    eval_examples: tuple[Mapping[str, Any], ...] = ()
    eval_fraction: float = 0.0
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    max_prompt_len: int = 256
    max_completion_len: int = 256
    pairs_per_step: int = 8
    num_microbatches: int = 1
    logprob_chunk: int = 256
    reference_cache: bool = True
    eval_at_start: bool = True
    eval_at_end: bool = True
    from_archive: str = ""

    def __post_init__(self):
        checks = {f"loss (one of {LOSS_NAMES})": self.loss in LOSS_NAMES, "beta (> 0)": self.beta > 0,
                  "label_smoothing (in [0, 0.5))": 0.0 <= self.label_smoothing < 0.5,
                  "label_smoothing (sigmoid loss only)": not (self.label_smoothing and self.loss != "sigmoid"),
                  "max_prompt_len (>= 1)": self.max_prompt_len >= 1,
                  "max_completion_len (>= 1)": self.max_completion_len >= 1,
                  "pairs_per_step (>= 1)": self.pairs_per_step >= 1,
                  **offline_checks(self)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            shown = {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_examples")}
            raise ValueError(f"invalid {', '.join(bad)} in dpo: {shown}")


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
