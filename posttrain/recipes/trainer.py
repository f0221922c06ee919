"""`GRPOTrainer`: a GRPO run driven step by step from Python with `grpo.train`'s semantics (docs/commands.md)."""
from __future__ import annotations

import copy
import importlib.util
import pathlib
from typing import Any, Mapping

from posttrain.config import Config, from_config_dict, to_dict
from posttrain.infra import distributed
from posttrain.infra.partitioning import use_rules
from posttrain.recipes import grpo
from posttrain.runs.resources import Resources
from posttrain.config.load import config_for_run
from posttrain.config.plan import RunPlan, make_run_plan


def load_config_file(path) -> Any:
    """A config file's `get_config()` result (`configs/X.py` or `configs/X.py:ARG`); FileNotFoundError if none."""
    text = str(path)
    file, _, arg = text.partition(":") if not pathlib.Path(text).is_file() else (text, "", "")
    if not pathlib.Path(file).is_file():
        raise FileNotFoundError(f"config file {file!r}: no such file (a configs/*.py file with get_config())")
    spec = importlib.util.spec_from_file_location(f"posttrain_config_{pathlib.Path(file).stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def apply_overrides(raw: dict, overrides: Mapping[str, Any]) -> dict:
    """`raw` with each dotted key of `overrides` set (as `--config.rl.group_size=8`); ValueError for a non-dict path."""
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = raw
        for i, part in enumerate(path):
            if not isinstance(node.get(part) if isinstance(node, dict) else None, dict):
                raise ValueError(f"override {key!r}: {'.'.join(path[:i + 1])!r} is not a config section")
            node = node[part]
        node[last] = value
    return raw


def make_plan(cfg_or_path, *, workdir: str | None = None, overrides: Mapping[str, Any] | None = None) -> RunPlan:
    """The validated run plan of `cfg_or_path`, with `overrides` (dotted keys) applied.

    `cfg_or_path`: a RunPlan (as is), a Config, ConfigDict or plain dict, a config file (`load_config_file`) or a run's
    directory (its saved config.json; the workdir defaults to it). Raises ConfigError, FileNotFoundError, or TypeError
    for a RunPlan given with overrides or a workdir (a plan is final)."""
    if isinstance(cfg_or_path, RunPlan):
        if overrides or workdir:
            raise TypeError("a RunPlan is final: pass the Config (or its file) to apply overrides or a workdir")
        return cfg_or_path
    if isinstance(cfg_or_path, (str, pathlib.Path)) and pathlib.Path(cfg_or_path).is_dir():
        workdir = workdir or str(cfg_or_path)
        cfg_or_path = config_for_run(cfg_or_path)
    elif isinstance(cfg_or_path, (str, pathlib.Path)):
        cfg_or_path = load_config_file(cfg_or_path)
    if overrides or not isinstance(cfg_or_path, Config):
        raw = to_dict(cfg_or_path) if isinstance(cfg_or_path, Config) else (
            cfg_or_path.to_dict() if hasattr(cfg_or_path, "to_dict") else copy.deepcopy(dict(cfg_or_path)))
        cfg_or_path = from_config_dict(apply_overrides(raw, overrides or {}))
    return make_run_plan(cfg_or_path, workdir=workdir)


class GRPOTrainer:
    """A GRPO run driven step by step, a context manager; build it with `from_config`.

    Attributes:
        plan: its run plan.
        global_step: completed updates.
        done: `train.steps` reached or `train.max_train_seconds` spent.
        summary: what summary.json holds (complete after `close`)."""

    def __init__(self, plan: RunPlan, *, progress: bool = False, allow_config_change: bool = False):
        self.plan, self._closed, self._timed_out = plan, False, False
        self._res = Resources()
        with use_rules(plan.rules), self._res.on_error():  # a failed start closes what it opened
            self._loop = grpo.open_run(plan, self._res, None, progress=progress,
                                       allow_config_change=allow_config_change)

    @classmethod
    def from_config(cls, cfg_or_path, *, workdir: str | None = None, overrides: Mapping[str, Any] | None = None,
                    progress: bool = False, allow_config_change: bool = False) -> "GRPOTrainer":
        """Opens (or resumes) the run of `cfg_or_path` (as `make_plan` takes it); raises as `grpo.train` does."""
        plan = make_plan(cfg_or_path, workdir=workdir, overrides=overrides)
        return cls(plan, progress=progress, allow_config_change=allow_config_change)

    @property
    def global_step(self) -> int:
        return self._loop.learner.step

    @property
    def done(self) -> bool:
        return self._timed_out or self.global_step >= self.plan.config.train.steps

    @property
    def summary(self) -> dict:
        return self._loop.summary

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the GRPOTrainer of {self.plan.workdir} is closed")

    def step(self) -> dict[str, float]:
        """Runs one step; returns the metrics row it wrote to metrics.jsonl (eval/* when due).

        Raises ValueError once `done` (raise train.steps to train further: the learning-rate schedule follows it),
        RuntimeError after `close`, NonFiniteError / RunInterrupted as `train` does (the state saved first)."""
        self._check_open()
        steps = self.plan.config.train.steps
        if self.done:
            why = "train.max_train_seconds spent" if self._timed_out else f"train.steps={steps} reached"
            raise ValueError(f"{why} at step {self.global_step}: nothing left to train in this run (raise "
                             "train.steps, e.g. overrides={'train.steps': N}, to train further)")
        with use_rules(self.plan.rules), distributed.StopRequest(self.plan.config.checkpoint.stop_grace_s) as stop:
            self._loop.stop = stop
            self._timed_out = self._loop.advance(self.global_step, steps)
        return dict(self._loop.metrics)

    def evaluate(self) -> dict[str, float]:
        """eval/* metrics of the current policy on the held-out episodes ({} without), recorded in eval/ only."""
        self._check_open()
        loop = self._loop
        if not loop.episodes:
            return {}
        with use_rules(self.plan.rules), loop.clock.paused(), loop.queue.exclusive():
            return grpo.evaluate(self.plan, loop.rollouter, loop.learner, loop.episodes)

    def save(self) -> int:
        """Saves a checkpoint of the current step now, with its rollout state, and waits for it; returns the step."""
        self._check_open()
        self._loop.learner.save(self._loop.resume, force=True)  # the rollout state of the last trained batch
        self._loop.learner.wait()
        return self.global_step

    def close(self) -> dict:
        """Ends the run as `train` does (final checkpoint, end-of-run eval, summary.json); returns the summary."""
        if not self._closed:
            self._closed = True
            with use_rules(self.plan.rules), self._res:  # closed in reverse order, also when finishing fails
                self._loop.finish()
        return self.summary

    def __enter__(self) -> "GRPOTrainer":
        return self

    def __exit__(self, typ, error, tb) -> None:
        if error is None:
            self.close()
        elif not self._closed:  # as `train` on an error: no final checkpoint or evaluation, every part closed
            self._closed = True
            self._res.close(error)
