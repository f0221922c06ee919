"""The directory a command writes, checked before anything is written (`claim`, `check_export_dir`; docs/runs.md)."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping

from posttrain.config import ConfigError, config_changes
from posttrain.runs import read as read_run

RUN_MARKERS = ("checkpoints", "metrics.jsonl", "summary.json", "archive")  # what a posttrain run writes
# settings a resumed run may change without --allow_config_change (extending a run, another directory name)
RESUME_FREE_KEYS = ("train.steps", "train.workdir", "train.max_train_seconds")  # change on resume, recorded
UNRECORDED_KEYS = ("train.workdir",)  # where the run is, not how it runs


def check_writable(path, flag: str = "--workdir") -> pathlib.Path:
    """`path` as a Path when this process may create or write that directory; else ConfigError naming `flag`."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}={path}: is a file, not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag}={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}={path}: {existing} is not writable (a read-only file system or its permissions)")
    return path


def is_run_dir(path) -> bool:
    """True when `path` holds what a posttrain run writes (checkpoints/, metrics.jsonl, summary.json, archive/)."""
    return any((pathlib.Path(path) / m).exists() for m in RUN_MARKERS)


def claim(workdir, kind: str, config_dict: Mapping, *, defaults: Mapping | None = None,
          free_keys: tuple = (), allow_changes: bool = False) -> dict[str, list]:
    """Checks that a `kind` run may write `workdir` with `config_dict` (docs/runs.md); writes nothing.

    Returns {dotted key: [saved, new, checkpoint step]} of the settings a resume changes, `free_keys` included
    (`defaults`: as `config_changes` takes them; `UNRECORDED_KEYS` left out). Raises ConfigError naming the path
    for each refusal (changed settings outside `free_keys`: only without `allow_changes`)."""
    workdir = check_writable(workdir)
    saved_path = workdir / "config.json"
    if not saved_path.is_file():
        return {}
    saved = _read_json(saved_path)
    if not _is_run_config(saved):
        keys = (f"keys {sorted(saved)[:6]}" if isinstance(saved, dict) else
                "not JSON" if saved is None else f"a JSON {type(saved).__name__}")
        raise ConfigError(f"--workdir={workdir}: its config.json is not a posttrain run's ({keys}); give another "
                          "--workdir")
    existing = read_run.kind_of(saved)
    if existing != kind:
        raise ConfigError(f"--workdir={workdir} holds {read_run.KIND_NAMES[existing]}; {read_run.KIND_NAMES[kind]} "
                          "would overwrite it: give another --workdir")
    from posttrain.runs.lookup import latest_checkpoint

    step = latest_checkpoint(workdir)
    if step is None:
        return {}
    every = config_changes(saved, config_dict, defaults=defaults)
    changes = {k: v for k, v in every.items() if k not in free_keys}
    if changes and not allow_changes:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
        how = (f"(`posttrain train --workdir={workdir}` alone uses them) or resume with these, recorded in "
               "config_changes.jsonl: --allow_config_change on the command line, allow_config_change=True in "
               "grpo.train(...) / GRPOTrainer(...)" if kind == "grpo"
               else "(its config.json) or give another --workdir to start a new run")
        raise ConfigError(f"resuming {workdir} (checkpoint {step}) with changed settings: {listed}; resume with the "
                          f"saved ones {how}")
    return {k: [old, new, step] for k, (old, new) in every.items() if k not in UNRECORDED_KEYS}


def _read_json(path: pathlib.Path):
    """The JSON value in `path`, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _is_run_config(raw) -> bool:
    return isinstance(raw, dict) and {"model", "train"} <= set(raw)


def write_config(workdir, config_dict: Mapping) -> None:
    """Creates `workdir` and writes its config.json (after `claim`, once a resumed checkpoint is restored)."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config_dict, indent=2, default=str))


def check_export_dir(out, *, source=None) -> pathlib.Path:
    """`out` for `convert --out`: a writable directory, neither a posttrain run nor `source`; else ConfigError."""
    out = check_writable(out, "--out")
    if source is not None and out.resolve() == pathlib.Path(source).resolve():
        raise ConfigError(f"--out={out} is the run being exported (--checkpoint): give a new directory")
    if is_run_dir(out) or _is_run_config(_read_json(out / "config.json")):
        raise ConfigError(f"--out={out} holds a posttrain run: exporting there would overwrite its config.json; "
                          "give a new directory")
    return out


def claim_offline(workdir: pathlib.Path, kind: str, config_dict: Mapping, run_cls) -> None:
    """`claim` for an offline run of `kind` (config dataclass `run_cls`); its evaluations may change on a resume too."""
    import dataclasses

    claim(workdir, kind, config_dict, defaults=dataclasses.asdict(run_cls()),
                      free_keys=RESUME_FREE_KEYS + (f"{kind}.eval_at_start", f"{kind}.eval_at_end"))
