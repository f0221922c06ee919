"""Metrics: device-side masked reductions, and the host-side writers the training loop uses.

Reductions are float32; masked positions never reach the arithmetic (NaN/inf cannot leak); nothing counted: 0."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

__all__ = ["REDUCTIONS", "MetricsWriter", "ProgressBar", "cut_step_files", "masked_max", "masked_mean", "masked_min",
           "read_metrics", "read_tensorboard_scalars"]

log = logging.getLogger(__name__)


def peak_rss_gb() -> float:
    """This process's peak resident set size in GiB (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def step_perf(tokens: int, t_start: float, t_update: float, t_end: float) -> dict[str, float]:
    """perf/* metrics of one training step from its `time.perf_counter()` marks (start, update start, end)."""
    return {"perf/step_s": t_end - t_start, "perf/train_s": t_end - t_update,
            "perf/tokens_per_s": tokens / (t_end - t_start), "perf/peak_rss_gb": peak_rss_gb()}


class TrainClock:
    """Training wall time: seconds since construction minus those spent inside `paused()` (evaluation)."""

    def __init__(self):
        self._start, self._paused = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start - self._paused


# ----------------------------------------------------------------------------- device side
def _count(x, mask, axis):
    mask = jnp.broadcast_to(jnp.asarray(mask).astype(bool), jnp.shape(x))
    return mask, mask.sum(axis=axis)


def masked_mean(x, mask, axis=None):
    """Mean of x over positions where mask (broadcast to x) is true (float32); 0 where nothing is counted."""
    mask, n = _count(x, mask, axis)
    total = jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0).sum(axis=axis)
    return total / jnp.maximum(n, 1)


def masked_max(x, mask, axis=None):
    """Max of x over positions where mask is true (float32); 0 where nothing is counted."""
    mask, n = _count(x, mask, axis)
    m = jnp.where(mask, jnp.asarray(x, jnp.float32), -jnp.inf).max(axis=axis)
    return jnp.where(n > 0, m, 0.0)


def masked_min(x, mask, axis=None):
    """Min of x over positions where mask is true (float32); 0 where nothing is counted."""
    return -masked_max(-jnp.asarray(x, jnp.float32), mask, axis)


REDUCTIONS: dict[str, Callable] = {"mean": masked_mean, "max": masked_max, "min": masked_min}


# ----------------------------------------------------------------------------- host side
def read_metrics(path: str | os.PathLike, max_step: int | None = None) -> list[dict[str, Any]]:
    """Records of metrics.jsonl with step <= max_step, malformed lines skipped; FileNotFoundError without the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    records, bad = [], 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                bad += line.strip() != ""
                continue
            if max_step is None or rec["step"] <= max_step:
                records.append(rec)
    if bad:
        log.warning("skipped %d malformed line(s) in %s", bad, path)
    return records


def _import_tensorboardx():
    """The `tensorboardX` module, imported without torch (which it imports when installed, costing time and RSS)."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX is imported
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


def read_tensorboard_scalars(logdir: str | os.PathLike) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files under `logdir`; FileNotFoundError if there is none."""
    import struct

    _import_tensorboardx()
    from tensorboardX.proto import event_pb2

    files = sorted(Path(logdir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {logdir}")
    out = []
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, int(event.step), float(v.simple_value)) for v in event.summary.value]
    return out


def cut_step_files(folder: str | os.PathLike, first_dropped: int) -> list[Path]:
    """Removes `folder/step_NNNNNN.jsonl` of steps >= first_dropped (a resume rewrites them); returns them sorted."""
    removed = []
    for path in sorted(Path(folder).glob("step_*.jsonl")):
        digits = path.stem.removeprefix("step_")
        if digits.isdigit() and int(digits) >= first_dropped:
            path.unlink()
            removed.append(path)
    return removed


def _to_float(name: str, value: Any) -> float | None:
    """A scalar (Python, NumPy or JAX) as a float; non-finite -> None (JSON null)."""
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - anything unconvertible is a caller error
        raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__} to a number") from e
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r} must be a real scalar, got dtype {arr.dtype} shape {arr.shape}")
    out = float(arr.reshape(()))
    return out if math.isfinite(out) else None


class MetricsWriter:
    """Writes metrics.jsonl, TensorBoard scalars and (throttled) reward_curve.png; several writes may share a step.

    Args:
      resume_step: the step a run (re)starts from (0: starts over): later records (all for 0) leave every output.
        None: append to whatever is there.
      plot_every_s: minimum seconds between PNG rewrites (always rewritten at close).
    """

    JSONL, PNG, TB_DIR = "metrics.jsonl", "reward_curve.png", "tensorboard"
    PLOTTED = ("reward/mean", "eval/pass@1")

    def __init__(self, workdir: str | os.PathLike, *, resume_step: int | None = None,
                 plot_every_s: float = 60.0, tensorboard: bool = True, plot: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path, self.png_path = self.workdir / self.JSONL, self.workdir / self.PNG
        keep = None if resume_step is None else (resume_step if resume_step > 0 else -1)
        history = read_metrics(self.jsonl_path, keep) if self.jsonl_path.exists() else []
        if resume_step is not None and self.jsonl_path.exists():
            tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")
            os.replace(tmp, self.jsonl_path)
        self.history: dict[str, list[tuple[int, float]]] = {k: [] for k in self.PLOTTED}
        for rec in history:
            self._remember(rec)
        self._file = self.jsonl_path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            SummaryWriter = _import_tensorboardx().SummaryWriter
            tb_dir = self.workdir / self.TB_DIR
            if resume_step is not None:  # events of dropped steps go: rewrite them from the lines kept
                for old in tb_dir.glob("events.out.tfevents.*"):
                    old.unlink()
            # a unique suffix: tensorboardX names files by the second, so a second writer within it would overwrite
            self._tb = SummaryWriter(logdir=str(tb_dir), filename_suffix=f".{os.getpid()}.{time.time_ns()}")
            for rec in history if resume_step is not None else ():
                self._tb_write(rec)
        self._plot, self._plot_every_s, self._last_plot = plot, plot_every_s, -math.inf
        if plot and resume_step is not None and self.png_path.exists():
            self.plot()

    def _tb_write(self, record: Mapping[str, Any]) -> None:
        for name, value in record.items():
            if name != "step":
                self._tb.add_scalar(name, math.nan if value is None else value, int(record["step"]))

    def _remember(self, rec: Mapping[str, Any]) -> None:
        for key in self.PLOTTED:
            if rec.get(key) is not None:
                self.history[key].append((rec["step"], rec[key]))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` (name -> real scalar) at `step` (int >= 0); non-finite values become null.

        Raises TypeError on a non-int step, a non-str name or a non-scalar value; ValueError on a negative step
        or the reserved name "step"."""
        if self._file is None:
            raise ValueError("MetricsWriter is closed")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if step < 0 or "step" in metrics:
            raise ValueError(f"step must be >= 0 and not a metric name, got step={step}, names={sorted(metrics)}")
        record: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"metric names must be str, got {name!r}")
            record[name] = _to_float(name, value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_write(record)
        self._remember(record)
        if self._plot and time.monotonic() - self._last_plot >= self._plot_every_s:
            self.plot()

    def plot(self) -> None:
        """Rewrites reward_curve.png from the whole history (atomically: temp file + rename)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, label, style in (("reward/mean", "train reward/mean", "-"), ("eval/pass@1", "eval/pass@1", "o-")):
            if self.history[key]:
                steps, values = zip(*self.history[key])
                ax.plot(steps, values, style, label=label, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(self.workdir.name)
        ax.grid(alpha=0.3)
        if any(self.history.values()):
            ax.legend(loc="best")
        tmp = self.png_path.with_suffix(".png.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, self.png_path)
        self._last_plot = time.monotonic()

    def close(self) -> None:
        """Writes the final PNG, flushes and closes every output. Idempotent."""
        if self._file is None:
            return
        if self._plot:
            self.plot()
        self._file.close()
        self._file = None
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressBar:
    """A tqdm bar over training steps whose postfix shows `fields` (label -> metric name; missing ones left out)."""

    def __init__(self, total_steps: int, *, initial_step: int = 0, desc: str = "train",
                 fields: Mapping[str, str] = (("reward", "reward/mean"), ("step_s", "perf/step_s")),
                 file: io.TextIOBase | None = None, disable: bool = False):
        from tqdm import tqdm

        self.fields = dict(fields)
        self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, file=file or sys.stderr,
                         disable=disable, dynamic_ncols=True)

    def update(self, metrics: Mapping[str, Any], n: int = 1) -> None:
        """Advances by n steps and shows the fields present in `metrics` (3 significant digits)."""
        postfix = {}
        for label, name in self.fields.items():
            if name in metrics:
                value = _to_float(name, metrics[name])
                postfix[label] = "nan" if value is None else f"{value:.3g}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
