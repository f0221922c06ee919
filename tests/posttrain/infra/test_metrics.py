"""Tests for posttrain.infra.metrics: masked reductions vs NumPy, JSONL/TensorBoard/PNG writers, progress bar."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.infra import metrics
from posttrain.infra.metrics import read_tensorboard_scalars as read_tb_scalars
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----- device side -----
def np_reduce(kind, x, mask, axis):
    fn = {"mean": np.mean, "max": np.max, "min": np.min}[kind]
    if axis is None:
        return fn(x[mask]) if mask.any() else 0.0
    return np.array([fn(r[m]) if m.any() else 0.0 for r, m in zip(x, mask)])


@pytest.mark.parametrize("kind", sorted(metrics.REDUCTIONS))
@pytest.mark.parametrize("axis", [None, -1])
def test_masked_reductions_match_numpy(kind, axis):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 7)).astype(np.float32)
    mask = rng.random((4, 7)) > 0.5
    mask[1] = False  # an empty row
    x_bad = np.where(mask, x, np.nan)
    x_bad[0, ~mask[0]] = np.inf  # garbage at masked positions must not leak
    got = jax.jit(metrics.REDUCTIONS[kind], static_argnums=2)(x_bad, mask, axis)
    np.testing.assert_allclose(np.asarray(got), np_reduce(kind, x, mask, axis), rtol=1e-6)
    assert got.dtype == jnp.float32


def test_masked_reductions_of_nothing_are_zero():
    for fn in metrics.REDUCTIONS.values():
        assert float(fn(jnp.array([np.nan, 5.0]), jnp.array([0, 0]))) == 0.0


# ----- host side -----
def write_steps(workdir, steps, **kw):
    with metrics.MetricsWriter(workdir, **kw) as w:
        for s in steps:
            w.write(s, {"reward/mean": s / 10, "policy/loss": np.float32(-s), "optim/lr": jnp.float32(1e-3),
                        "perf/step_s": 2})
    return w


def test_jsonl_round_trip(tmp_path):
    write_steps(tmp_path, range(3))
    with metrics.MetricsWriter(tmp_path, plot=False, tensorboard=False) as w:
        w.write(3, {"eval/pass@1": 0.5, "policy/loss": float("nan"), "x": np.array([[7]])})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == metrics.read_metrics(tmp_path / "metrics.jsonl")
    recs = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert recs[1] == {"step": 1, "reward/mean": 0.1, "policy/loss": -1.0,
                       "optim/lr": pytest.approx(1e-3), "perf/step_s": 2.0}
    assert recs[3] == {"step": 3, "eval/pass@1": 0.5, "policy/loss": None, "x": 7.0}  # NaN -> null


def test_resume_drops_later_steps_and_keeps_whole_history(tmp_path):
    write_steps(tmp_path, range(10))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "reward/me')  # a line cut short by a crash
    w = write_steps(tmp_path, range(6, 9), resume_step=5, plot_every_s=0.0)
    steps = [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(9))  # 6..9 of the first run and the partial line are gone; no duplicates
    assert [s for s, _ in w.history["reward/mean"]] == list(range(9))  # plotted from the whole history
    assert metrics.read_metrics(tmp_path / "metrics.jsonl", max_step=2)[-1]["step"] == 2


# kind: every output a run appends to is cut back to the step it (re)starts from; 0 (no checkpoint) keeps nothing
@pytest.mark.parametrize("earlier,resume_step,rerun,kept", [
    ([0, 1], 0, [0, 1], [0, 1]),  # killed after step 1, before the first checkpoint; the same command again
    ([0, 1, 2, 3], 0, [0], [0]),  # a run with no usable checkpoint starts over and keeps nothing of the last one
    ([0, 1, 2, 3], 2, [3, 4], [0, 1, 2, 3, 4]),  # killed after step 3's write, before its checkpoint
    (list(range(10)), 5, [6, 7, 8], list(range(9))),  # a longer earlier attempt: 9 goes although not rewritten
    ([0, 1, 2], 4, [5], [0, 1, 2, 5]),  # nothing to cut (the lines ended before the checkpoint)
    ([0, 1], None, [1], [0, 1, 1]),  # None appends (for callers that are not runs)
])
def test_resume_cuts_jsonl_tensorboard_and_plot_back_to_the_resume_step(tmp_path, earlier, resume_step, rerun, kept):
    write_steps(tmp_path, earlier)
    if resume_step is not None:
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('{"step": 99, "reward/me')  # a line cut short by a kill
    w = write_steps(tmp_path, rerun, resume_step=resume_step, plot_every_s=3600)
    assert [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")] == kept
    tb = sorted(s for t, s, _ in read_tb_scalars(tmp_path / "tensorboard") if t == "policy/loss")
    assert tb == (sorted(kept) if resume_step is not None else sorted(earlier + rerun))
    assert [s for s, _ in w.history["reward/mean"]] == kept  # what the PNG draws


def test_png_is_valid_and_throttled(tmp_path):
    png = tmp_path / "reward_curve.png"
    w = metrics.MetricsWriter(tmp_path, plot_every_s=3600, tensorboard=False)
    w.write(0, {"reward/mean": 0.1})
    assert png.read_bytes()[:8] == PNG_MAGIC  # first write plots
    png.unlink()
    w.write(1, {"reward/mean": 0.2, "eval/pass@1": 0.3})
    assert not png.exists()  # throttled
    w.close()
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert img.shape[:2] == (400, 700) and img.std() > 0  # something was drawn
    assert not list(tmp_path.glob("*.tmp"))
    w.close()  # idempotent


def test_tensorboard_events_written(tmp_path):
    write_steps(tmp_path, range(3))
    scalars = read_tb_scalars(tmp_path / "tensorboard")
    assert ("reward/mean", 2, pytest.approx(0.2)) in scalars
    assert sorted(s for t, s, _ in scalars if t == "policy/loss") == [0, 1, 2]


@pytest.mark.parametrize("names,first_dropped,left", [
    ([0, 1, 2, 7], 2, [0, 1]), ([0, 1, 2, 7], 0, []), ([3], 4, [3]), ([], 0, [])])
def test_cut_step_files_removes_steps_from_the_first_dropped_on(tmp_path, names, first_dropped, left):
    for n in names:
        (tmp_path / f"step_{n:06d}.jsonl").write_text("{}\n")
    (tmp_path / "step_notes.jsonl").write_text("")  # not a step record: untouched
    removed = metrics.cut_step_files(tmp_path, first_dropped)
    assert sorted(int(p.stem[5:]) for p in tmp_path.glob("step_0*.jsonl")) == left
    assert len(removed) == len(names) - len(left) and (tmp_path / "step_notes.jsonl").exists()
    assert metrics.cut_step_files(tmp_path / "missing", 0) == []


def test_bad_metrics_raise_clear_errors(tmp_path):
    with metrics.MetricsWriter(tmp_path, plot=False, tensorboard=False) as w:
        with pytest.raises(TypeError, match="'policy/loss' must be a real scalar"):
            w.write(0, {"policy/loss": np.ones(3)})
        with pytest.raises(TypeError, match="'tag'"):
            w.write(0, {"tag": "abc"})
        with pytest.raises(TypeError, match="step must be an int"):
            w.write(1.5, {})
        with pytest.raises(ValueError, match="step must be >= 0"):
            w.write(-1, {})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing half-written
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        metrics.read_metrics(tmp_path / "missing.jsonl")


def test_progress_bar_shows_reward_and_step_time():
    stream = io.StringIO()
    bar = metrics.ProgressBar(10, initial_step=2, file=stream)
    bar.update({"reward/mean": jnp.float32(0.4567), "perf/step_s": 12.34, "policy/loss": 1.0})
    bar.close()
    text = stream.getvalue()
    assert "3/10" in text and "reward=0.457" in text and "step_s=12.3" in text and "loss" not in text


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch whenever it is installed (the dev extra installs it): a run that never uses
    torch must not pay its import (~1.3 s, hundreds of MB). A fresh process writes and reads events without it, and
    torch still imports afterwards."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    code = ("import sys; from posttrain.infra.metrics import MetricsWriter, read_tensorboard_scalars as r\n"
            f"w = MetricsWriter({str(tmp_path)!r}, plot=False); w.write(0, {{'reward/mean': 0.5}}); w.close()\n"
            f"assert 'torch' not in sys.modules, 'torch imported'; assert r({str(tmp_path / 'tensorboard')!r})\n"
            "import torch; print(torch.ones(1).sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1.0", out.stderr[-2000:]
