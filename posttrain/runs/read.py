"""Reading a run of any kind posttrain writes (GRPO, SFT, DPO, reward model; LoRA or full) for the commands that
only read one (`eval`, `sample`, `convert`, `status`): the run's saved config.json is the source of truth, and a
command that cannot apply to a run kind refuses with one line naming why (a ConfigError: exit code 2).

The kind is the saved config's recipe section: `sft`, `dpo` or `rm` (the offline recipes' own section beside the
shared ones), else GRPO (`rl`). What each command reads:

  kind  | eval                                  | sample           | convert                         | status
  grpo  | its config (`run_plan.config_for_run`)| its policy       | its policy (HF causal LM)       | its view
  sft   | `policy_eval_config`                  | its policy       | its policy (HF causal LM)       | refused
  dpo   | `policy_eval_config`                  | its policy       | its policy (HF causal LM)       | refused
  rm    | refused (it scores, it has no policy) | refused          | HF sequence classifier          | refused

An SFT or DPO run has no environment of its own: `eval` takes the env and eval sections from --config, else from
the GRPO run it was trained from (`<section>.from_archive`, that run's config.json), else refuses naming --config
(`eval --suite` then takes the defaults: a suite evaluation builds only the suite's envs); the policy's shape and
state (`model`, `lora`, `optim`, `checkpoint`) are always the run's.
"""
from __future__ import annotations

import json
import pathlib

from posttrain.config import ConfigError

OFFLINE_KINDS = ("sft", "dpo", "rm")
# the sections an offline run's checkpoint is shaped by (params, adapters, optimizer state) and saved with
OFFLINE_STATE_SECTIONS = ("model", "lora", "optim", "checkpoint")
KIND_NAMES = {"sft": "an SFT run (posttrain sft)", "dpo": "a DPO run (posttrain dpo)",
         "rm": "a reward-model run (posttrain rm)", "grpo": "a GRPO run (posttrain train)"}


def run_kind(workdir) -> str | None:
    """"grpo", "sft", "dpo" or "rm": the kind of the run in `workdir` by its saved config.json's sections (None
    without one). Raises ConfigError naming the file when it is no JSON object."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a run's config.json holds an object, not {type(raw).__name__}")
    return kind_of(raw)


def kind_of(raw: dict) -> str:
    """"grpo", "sft", "dpo" or "rm": the kind of a run by the sections of its parsed config.json."""
    return next((k for k in OFFLINE_KINDS if k in raw), "grpo")


def refuse(workdir, kind: str, command: str, why: str):
    """The one-line ConfigError of a command that does not apply to the run kind."""
    return ConfigError(f"--checkpoint={workdir} is {KIND_NAMES[kind]}: {command} {why}")
