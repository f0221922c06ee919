"""kill -9 at three seeded points of a tiny-model run with the job scheduler (issue 23 acceptance 3): inside an archive
write, inside a checkpoint save and inside a rollout (after a report), each followed by the same command. The
archive then equals an uninterrupted run's row for row (timings aside), with no key twice and none missing, and
the scheduler state saved with the last checkpoint equals too. The run is test_attempts' flaky three-domain mix
(retries, re-queues, quarantine and a paused domain all happen), its replies scripted from the sampling key."""
import json
import pathlib
import random
import signal
import subprocess
import sys

import pytest

from posttrain.scheduling import archive

HERE = pathlib.Path(__file__).resolve().parent
STEPS = 8
CHILD = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {here!r}]
import pytest
import test_attempts as tt
from posttrain.recipes import grpo
from posttrain.rollout.rollouter import Rollouter
from posttrain.scheduling import archive
from posttrain.scheduling.scheduler import JobScheduler
from orbax.checkpoint import JsonCheckpointHandler

workdir, where, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
calls = [0]

def due():
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)

def write_table(*args, _write=archive.pq.write_table, **kwargs):  # the temp file written, not yet renamed
    _write(*args, **kwargs)
    due()

async def save_json(self, item, directory, _save=JsonCheckpointHandler._save_fn):  # the meta item written
    await _save(self, item, directory)
    if "scheduler" in item:
        due()

def report(self, outcomes, _report=JobScheduler.report):
    result = _report(self, outcomes)
    due()
    return result

with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Rollouter, "sample_fn", tt.scripted_sample_fn)
    target = {{"archive": (archive.pq, "write_table", write_table),
               "checkpoint": (JsonCheckpointHandler, "_save_fn", save_json),
               "rollout": (JobScheduler, "report", report)}}.get(where)
    if target:
        mp.setattr(*target)
    grpo.train(tt.flaky_config(workdir, **{{"train.steps": {steps}, "checkpoint.every_steps": 2}}), progress=False)
"""


def train(workdir, where="none", nth=0) -> int:
    code = CHILD.format(tests=str(HERE.parents[1]), here=str(HERE), steps=STEPS)
    res = subprocess.run([sys.executable, "-c", code, str(workdir), where, str(nth)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode in (0, -signal.SIGKILL), res.stderr[-3000:]
    return res.returncode


def final_scheduler_state(workdir) -> dict:
    return json.loads((workdir / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())["scheduler"]


@pytest.mark.slow
def test_kill_9_at_three_seeded_points_then_resume_equals_the_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"  # one run name: the episode ids can be compared
    assert train(a) == 0
    rng = random.Random(23)
    points = [("archive", rng.randint(2, 4)), ("checkpoint", rng.randint(1, 2)), ("rollout", rng.randint(3, 30))]
    for where, nth in points:
        assert train(b, where, nth) == -signal.SIGKILL, (where, nth)
        if where == "archive":  # the write killed midway left its temp file only: no reader sees it
            assert list(archive.archive_dir(b).glob(".step_*.tmp")) and len(archive.step_files(b)) == nth - 1
    assert train(b) == 0
    timings = ["sampler_s", "env_s"]
    rows_a, rows_b = (archive.read(w).drop_columns(timings).to_pylist() for w in (a, b))
    keys = [(r["episode_id"], r["attempt"]) for r in rows_b]
    assert len(set(keys)) == len(keys) == len(rows_a) > STEPS * 16 and rows_b == rows_a
    assert not list(archive.archive_dir(b).glob(".step_*.tmp"))
    assert final_scheduler_state(b) == final_scheduler_state(a)
