"""The offline loop (SFT, DPO, RM) with a fake learner: steps, metrics and checkpoints in order; SIGINT during a batch
or an update saves a checkpoint at the last completed step and raises RunInterrupted naming it (an update is never
cut in half); a non-finite run stops with a checkpoint; every resource is closed whatever happens. A real tiny SFT
run under SIGTERM (a subprocess) saves, exits within 30 s and resumes from the saved step; one whose step in flight
outlasts the grace period is cut, with its last finished step on disk (a guard checkpoint) to resume from."""
import json
import os
import signal

import pytest

from posttrain.infra import distributed
from posttrain.learn.learner import Learner
from posttrain.learn import offline_loop
from posttrain.recipes.grpo import NonFiniteError
from posttrain.learn.learner import TrainConfig


class FakeCheckpointer:
    directory = "ckpts"

    def __init__(self):
        self.saved = []

    def latest_step(self):
        return self.saved[-1] if self.saved else None


class FakeLearner:
    def __init__(self, every=2, nonfinite_from=None, signal_in_update=None):
        self.step, self.nonfinite_run, self.every = 0, 0, every
        self.nonfinite_from, self.signal_in_update = nonfinite_from, signal_in_update
        self.checkpointer, self.closed = FakeCheckpointer(), False

    def update(self, batch):
        if self.signal_in_update == self.step:
            os.kill(os.getpid(), signal.SIGINT)  # delivered now, raised when the update's block ends
        self.step += 1
        bad = self.nonfinite_from is not None and self.step >= self.nonfinite_from
        self.nonfinite_run = self.nonfinite_run + 1 if bad else 0
        return {"sft/loss": float(batch), "policy/skipped_nonfinite": float(bad)}

    def save(self, meta, force=False):
        if force or self.step % self.every == 0:
            if self.checkpointer.latest_step() != self.step:
                self.checkpointer.saved.append(self.step)

    def wait(self):
        pass

    def close(self):
        self.closed = True

    stop_checkpoint = Learner.stop_checkpoint  # the one stop path every loop shares, on this fake's state


class FakeRun:
    counts = {"examples": 3}

    def __init__(self, learner, signal_in_batch=None):
        self.learner, self.signal_in_batch = learner, signal_in_batch

    def batch(self, step):
        if step == self.signal_in_batch:
            os.kill(os.getpid(), signal.SIGINT)  # raises here: the batch is abandoned
        return step

    def evaluate(self):
        return {"sft/eval_loss": 1.0}

    def tokens(self, batch):
        return 10


def loop(run, tmp_path, steps=6, max_nonfinite=3):
    return offline_loop.train_loop(run, name="sft", workdir=tmp_path, train_config=TrainConfig(
        steps=steps, max_train_seconds=0, max_nonfinite_skips=max_nonfinite), config_dict={}, eval_at_start=True,
        eval_at_end=True, progress=False)


def logged_steps(tmp_path):
    return [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "sft/loss" in r]


def test_steps_metrics_and_checkpoints(tmp_path):
    learner = FakeLearner()
    summary = loop(FakeRun(learner), tmp_path)
    assert summary["end_step"] == 6 and learner.checkpointer.saved == [2, 4, 6] and learner.closed
    assert logged_steps(tmp_path) == [1, 2, 3, 4, 5, 6] and "eval_end" in summary


@pytest.mark.parametrize("where,at,saved_at", [("batch", 3, 3), ("update", 3, 4), ("batch", 0, None)])
def test_sigint_saves_the_last_completed_step_and_names_it(tmp_path, where, at, saved_at):
    learner = FakeLearner(every=100, signal_in_update=at if where == "update" else None)
    run = FakeRun(learner, signal_in_batch=at if where == "batch" else None)
    with pytest.raises(distributed.RunInterrupted) as e:
        loop(run, tmp_path)
    assert learner.step == (saved_at or 0) and learner.closed
    if saved_at:
        assert learner.checkpointer.saved == [saved_at]
        assert f"stopped at step {saved_at} (checkpoint {saved_at} in ckpts)" in str(e.value)
        assert logged_steps(tmp_path) == list(range(1, saved_at + 1))  # the update's metrics were written
    else:
        assert learner.checkpointer.saved == []  # no update completed: nothing to save


def test_a_run_of_nonfinite_steps_stops_with_a_checkpoint(tmp_path):
    learner = FakeLearner(every=100, nonfinite_from=2)
    with pytest.raises(NonFiniteError, match="stopped at step 4: 3 consecutive SFT steps"):
        loop(FakeRun(learner), tmp_path)
    assert learner.checkpointer.saved == [4] and learner.closed


def test_the_host_heap_is_trimmed_once_before_the_first_update(tmp_path, monkeypatch):
    learner = FakeLearner()
    at = []
    monkeypatch.setattr(offline_loop, "trim_host_heap", lambda: at.append(learner.step))
    loop(FakeRun(learner), tmp_path, steps=3)
    assert at == [0] and learner.step == 3


def test_a_tiny_sft_run_signalled_mid_run_exits_within_30_s_and_resumes_from_its_checkpoint(tmp_path):
    """`posttrain sft` on configs/sft_tiny.py (no periodic checkpoint before step 1000) gets SIGTERM after its
    third step: it saves the step it reached, exits 143 within 30 s naming it, and the same command resumes there."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = [sys.executable, "-m", "posttrain.cli", "sft", "--config=configs/sft_tiny.py", f"--workdir={tmp_path}",
            "--config.checkpoint.every_steps=1000", "--config.sft.eval_at_end=False", "--noprogress"]
    env = {**os.environ, "POSTTRAIN_XLA_CACHE": "0"}
    proc = subprocess.Popen(args + ["--config.train.steps=1000"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (tmp_path / "metrics.jsonl").is_file() and len(logged_steps(tmp_path)) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30 and proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    step = int(err.strip().splitlines()[-1].split("stopped at step ")[1].split()[0])
    assert step >= 3 and f"(checkpoint {step} in " in err and (tmp_path / "checkpoints" / str(step)).is_dir()
    res = subprocess.run(args + [f"--config.train.steps={step + 2}"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (out["start_step"], out["end_step"]) == (step, step + 2)
    assert logged_steps(tmp_path) == list(range(1, step + 3))  # no step twice, none lost


# a `posttrain` command whose steps take >= 1.1 s and whose step after `argv[1]` finished ones outlasts any grace:
# SIGTERM as it starts, then 60 s inside the update (a signal waits for a device computation the same way)
SLOW_STEPS = """
import os, signal, sys, time
from posttrain import cli
from posttrain.learn import learner as learner_lib
update, cut_at = learner_lib.Learner.update, int(sys.argv[1])
def slow_update(self, batch):
    if self.step == cut_at:
        self.wait()  # the guard save of the step before is committed (its write is no race on a loaded machine)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    time.sleep(1.1)
    return update(self, batch)
learner_lib.Learner.update = slow_update
sys.exit(cli.main(["posttrain", *sys.argv[2:]]))
"""


@pytest.mark.slow  # a subprocess SFT run cut by the watchdog (minutes on a loaded 2-core CPU); the guard decision
# itself runs in the default suite (test_learner: the fake-clock guard test) and guard retention in test_orbax
def test_a_step_past_the_grace_period_leaves_the_last_finished_step_to_resume_from(tmp_path):
    """Tiny SFT, 4 steps, no interval checkpoint, checkpoint.stop_grace_s=2, steps >= 1.1 s (over half the grace:
    each boundary is saved as a guard checkpoint): SIGTERM as step 3 starts and step 3 runs on, so the watchdog
    ends the run after 2 s (143); step 2, the last finished, is on disk (the only checkpoint: the guard of step 1
    went once it committed) and the run resumed from it logs steps 3 and 4 exactly as an uninterrupted run does."""
    import subprocess
    import sys

    from posttrain.checkpoints.orbax import Checkpointer
    from posttrain.config.sft import sft_config_from_dict
    from posttrain.recipes import sft
    from posttrain.recipes.trainer import load_config_file

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    over = {"checkpoint.every_steps": 1000, "checkpoint.stop_grace_s": 2, "train.steps": 4,
            "sft.eval_at_start": False, "sft.eval_at_end": False}
    cut = tmp_path / "cut"
    res = subprocess.run([sys.executable, "-c", SLOW_STEPS, "2", "sft", "--config=configs/sft_tiny.py",
                          f"--workdir={cut}", "--noprogress", *[f"--config.{k}={v}" for k, v in over.items()]],
                         cwd=root, env={**os.environ, "POSTTRAIN_XLA_CACHE": "0"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-2000:]
    assert "did not stop within 2 s" in res.stderr.strip().splitlines()[-1]
    with Checkpointer(cut / "checkpoints", every_steps=1, keep=1, read_only=True) as ck:
        assert ck.all_steps() == [2]
    assert logged_steps(cut) == [1, 2]

    def rows(workdir):  # `posttrain sft` on the same config in this process; its logged rows past step 2
        cfg = load_config_file(os.path.join(root, "configs", "sft_tiny.py"))
        for k, v in over.items():
            section, key = k.split(".")
            setattr(cfg[section], key, v)
        sft.train(sft.make_sft_plan(sft_config_from_dict(cfg), workdir=str(workdir)), progress=False)
        return [{k: v for k, v in r.items() if not k.startswith("perf/")}
                for r in map(json.loads, open(workdir / "metrics.jsonl")) if r["step"] > 2]

    resumed, uninterrupted = rows(cut), rows(tmp_path / "uninterrupted")
    assert [r["step"] for r in resumed] == [3, 4] and resumed == uninterrupted
