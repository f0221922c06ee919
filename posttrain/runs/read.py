"""Reading a run of any kind for the commands that only read one: its saved config.json is the source of truth.

A command that does not apply to a run kind refuses in one line (`refuse`); which does what: docs/runs.md."""
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
    """The kind ("grpo", "sft", "dpo", "rm") of the run in `workdir` by its config.json or None; ConfigError if bad."""
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
    """The kind of a run by the sections of its parsed config.json: "sft", "dpo" or "rm" when present, else "grpo"."""
    return next((k for k in OFFLINE_KINDS if k in raw), "grpo")


def refuse(workdir, kind: str, command: str, why: str):
    """The one-line ConfigError of a command that does not apply to the run kind."""
    return ConfigError(f"--checkpoint={workdir} is {KIND_NAMES[kind]}: {command} {why}")
