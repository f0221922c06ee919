"""The loop of offline recipes (SFT, DPO, reward models): updates, evaluation, checkpoints, resume (docs/learner.md)."""
from __future__ import annotations

import contextlib
import json
import pathlib
import time
from typing import Any, Callable, Mapping, Protocol

import jax
import numpy as np
from scipy import stats

from posttrain.infra import distributed, metrics as metrics_lib
from posttrain.learn.learner import Learner, NonFiniteError, TrainConfig, batch_shardings, trim_host_heap


class OfflineRun(Protocol):
    learner: Learner
    counts: Mapping[str, Any]

    def batch(self, step: int) -> Any: ...

    def evaluate(self) -> dict[str, float]: ...

    def tokens(self, batch) -> int: ...


def place(batch, mesh, rules):
    """A host batch placed on the mesh (rows split over its batch shards), as the learner places its own."""
    return jax.tree.map(distributed.global_array, batch, batch_shardings(mesh, batch, rules))


def train_loop(run: OfflineRun, *, name: str, workdir: pathlib.Path, train_config: TrainConfig, config_dict: Mapping,
               eval_at_start: bool, eval_at_end: bool, progress: bool,
               bar_fields: tuple = (), on_nonfinite: Callable[[], str] = lambda: "",
               stop: distributed.StopRequest | None = None) -> dict:
    """Runs (or resumes) `run` to `train_config.steps`; returns the summary (also written to summary.json).

    `stop`: the StopRequest the recipe entered before building `run` (None: one entered here). Raises NonFiniteError
    (after a save) after `train_config.max_nonfinite_skips` consecutive non-finite steps; RunInterrupted after SIGINT /
    SIGTERM, once the state is saved (the same call resumes from it)."""
    with contextlib.nullcontext(stop) if stop is not None else distributed.StopRequest() as stop:
        return _train_loop(run, stop, name=name, workdir=workdir, train_config=train_config, config_dict=config_dict,
                           eval_at_start=eval_at_start, eval_at_end=eval_at_end, progress=progress,
                           bar_fields=bar_fields, on_nonfinite=on_nonfinite)


def _train_loop(run: OfflineRun, stop: distributed.StopRequest, *, name, workdir, train_config, config_dict, eval_at_start,
                eval_at_end, progress, bar_fields, on_nonfinite) -> dict:
    learner = run.learner
    start, steps = learner.step, train_config.steps
    main = distributed.is_main_process()
    writer = metrics_lib.MetricsWriter(workdir, resume_step=start, plot=False) if main else None
    bar = metrics_lib.ProgressBar(steps, initial_step=start, desc=name, disable=not (progress and main),
                                  fields=bar_fields + (("step_s", "perf/step_s"),))
    summary = {"start_step": start, "data": dict(run.counts), "config": dict(config_dict)}
    clock = metrics_lib.TrainClock()
    meta = {name: dict(run.counts)}
    try:
        if start == 0 and eval_at_start:
            _evaluate(run, summary, "eval_start", 0, writer)
        # the model load's and evaluation's freed heap goes back first: the step's temporaries would peak on top
        trim_host_heap()
        _steps(run, stop, name=name, workdir=workdir, train_config=train_config, meta=meta, writer=writer, bar=bar, clock=clock,
               summary=summary, on_nonfinite=on_nonfinite)
        end = learner.step
        learner.save(meta, force=True)
        learner.wait()
        summary["train_wall_s"] = clock.seconds
        if eval_at_end and end > start:
            _evaluate(run, summary, "eval_end", end, writer)
    finally:
        learner.close()
        if writer:
            writer.close()
        bar.close()
    summary.update({"end_step": end, "peak_rss_gb": metrics_lib.peak_rss_gb()})
    if main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _steps(run: OfflineRun, stop: distributed.StopRequest, *, name, workdir, train_config, meta, writer, bar, clock,
           summary, on_nonfinite) -> None:
    """The steps from `learner.step` on; a signal never cuts an update, its metrics or its checkpoint."""
    learner = run.learner
    start = learner.step
    try:
        for step in range(start, train_config.steps):
            t0 = time.perf_counter()
            batch = run.batch(step)
            t1 = time.perf_counter()
            with stop.deferred():
                m = learner.update(batch)
                m.update(metrics_lib.step_perf(run.tokens(batch), t0, t1, time.perf_counter()))
                if writer:
                    writer.write(learner.step, m)
                bar.update(m)
                if learner.nonfinite_run >= train_config.max_nonfinite_skips:
                    learner.save(meta, force=True)
                    raise NonFiniteError(f"stopped at step {learner.step}: {learner.nonfinite_run} consecutive "
                                         f"{name.upper()} steps had a non-finite loss or gradient (nothing applied; "
                                         f"checkpoint saved in {workdir / 'checkpoints'}){on_nonfinite()}")
                learner.save(meta)
            stop.check()
            limit = train_config.max_train_seconds
            if limit and distributed.agree(clock.seconds >= limit):
                summary["stopped_early"] = f"max_train_seconds={limit} reached"
                break
    except distributed.RunInterrupted as e:  # the GRPO loop's stop too (`Learner.stop_checkpoint`)
        raise learner.stop_checkpoint(meta, e.signal_name, start) from None


def _evaluate(run: OfflineRun, summary: dict, key: str, step: int, writer) -> None:
    m = run.evaluate()
    if m:
        summary[key] = m
        if writer:
            writer.write(step, m)


def bootstrap_interval(x: np.ndarray, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of mean(x) (scipy.stats.bootstrap, 9999 resamples); equal values: (v, v)."""
    if len(x) < 2 or np.all(x == x[0]):
        v = float(x.mean()) if len(x) else float("nan")
        return v, v
    ci = stats.bootstrap((x,), np.mean, confidence_level=confidence, method="percentile",
                         random_state=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


def paired_difference_interval(a: np.ndarray, b: np.ndarray, confidence: float = 0.95,
                               seed: int = 0) -> tuple[float, float]:
    """A paired percentile bootstrap interval of mean(a) - mean(b) over per-item scores of the same items.

    scipy.stats.bootstrap(paired=True), 9999 resamples; equal differences give (d, d). ValueError on unequal lengths."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need equal lengths: {a.shape} vs {b.shape}")
    d = a - b
    if len(d) < 2 or np.all(d == d[0]):
        v = float(d.mean()) if len(d) else float("nan")
        return v, v
    ci = stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis), paired=True, vectorized=True,
                         confidence_level=confidence, method="percentile",
                         random_state=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)
