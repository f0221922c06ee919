"""`posttrain eval --suite` on the tiny model: a run's checkpoint against its base policy, paired by task, the report
files, the skipped domain, rescoring the written records (--from_records) and eval.seed in the run plan."""
import json
import pathlib

import pytest
from absl.testing import flagsaver

from helpers import tiny_config
from posttrain import cli
from posttrain.eval import records as records_lib
from posttrain.recipes import evaluate, grpo
from posttrain.config.plan import make_run_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose only checkpoint is its initial policy (step 0): no train step is compiled."""
    workdir = tmp_path_factory.mktemp("run")
    rollouter, learner, _ = grpo.build(make_run_plan(tiny_config(workdir)))
    learner.save(rollouter.state_dict(), force=True)
    learner.wait()
    learner.close()
    rollouter.close()
    return workdir


def test_suite_against_base_writes_the_report_and_rescoring_reproduces_it(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    out = tmp_path / "report"
    assert main("--suite=configs/eval/tiny.py", f"--checkpoint={run_dir}", "--baseline=base",
                "--domains=arithmetic,gsm8k", "--limit=4", f"--out={out}") == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["counts"] == {"improved": 0, "no change": 1, "regressed": 0}  # the same policy: no change
    assert result["skipped"]["gsm8k"].startswith("data absent") and "skipped: gsm8k (data absent" in printed
    assert "4 tasks in 1 domains" in printed and "minimum detectable effect on pass@1" in printed
    assert {p.name for p in out.iterdir()} == {"suite.json", "baseline", "candidate", "comparison.md",
                                               "comparison.json", "forest.png"}
    base, base_results = records_lib.read_evaluation(out / "baseline")
    cand, cand_results = records_lib.read_evaluation(out / "candidate")
    assert len(cand) == 4 and [r["replies"] for r in base] == [r["replies"] for r in cand]  # one sampling stream
    assert base_results["task_set_hash"] == cand_results["task_set_hash"] == result["task_set_hash"]
    assert base_results["step"] == 0 == cand_results["step"] and base_results["label"] == "base"
    assert set(cand_results["seconds"]) == {"arithmetic", "total"} and cand_results["perf/eval_s"] > 0
    assert set(cand_results["summary"]["domains"]["arithmetic"]) >= {"pass@1", "mean_reward", "format_rate",
                                                                     "mean_length", "truncation_rate"}
    rescored = evaluate.rescore_folder(str(out))
    assert rescored["task_set_hash"] == result["task_set_hash"] and rescored["counts"] == result["counts"]
    again, _ = records_lib.read_evaluation(out / "rescored" / "candidate")
    assert [r["rewards"] for r in again] == [r["rewards"] for r in cand]


def main(*args):
    with flagsaver.flagsaver():  # absl flags keep their values between in-process calls
        return cli.main(["posttrain", "eval", *args])


def test_bad_suite_invocations_fail_clearly(run_dir, tmp_path, capsys):
    for args, message in ((("--suite=configs/eval/none.py", f"--checkpoint={run_dir}"), "no such file"),
                          (("--suite=configs/eval/tiny.py", f"--checkpoint={run_dir}", "--domains=zzz"),
                           "'zzz' matches no domain"),
                          (("--suite=configs/eval/tiny.py",), "--checkpoint=<run workdir> is required")):
        assert main(*args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert main("--suite=configs/eval/tiny.py", f"--checkpoint={tmp_path}") == 2
    assert "no checkpoints/ folder" in capsys.readouterr().err and not (tmp_path / "eval").exists()


def test_eval_seed_sets_the_sampling_stream(tmp_path):
    assert make_run_plan(tiny_config(tmp_path, **{"eval.seed": 7})).eval_seed == 7
    assert make_run_plan(tiny_config(tmp_path, **{"train.seed": 3})).eval_seed == 4  # -1: train.seed + 1


def _tree(folder):
    """{relative path: (size, mtime_ns)} of every file and folder under `folder`."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def test_suite_report_goes_outside_the_run_which_stays_byte_identical(run_dir, tmp_path, monkeypatch, capsys):
    """eval only reads a run (issue 29 item 2): the default report folder is eval_reports/<run>/<suite>-step<N>
    under the current directory, and the run's files, sizes and mtimes are unchanged."""
    before = _tree(run_dir)
    monkeypatch.chdir(tmp_path)
    assert main(f"--suite={ROOT / 'configs/eval/tiny.py'}", f"--checkpoint={run_dir}",
                "--domains=arithmetic", "--limit=4") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"]
    assert out == f"eval_reports/{run_dir.name}/tiny-step0"
    assert (tmp_path / out / "candidate" / "records.jsonl").is_file()
    assert _tree(run_dir) == before


def test_a_suite_evaluation_needs_none_of_the_runs_own_envs(run_dir, tmp_path, capsys):
    """A run trained and evaluated on an env of the user's own ('my_envs:WordLength-v0'), read where its module is not
    importable: a suite evaluation builds only the suite's envs (and `sample` / `convert`, `grpo.run_policy`, none);
    plain `eval` evaluates the run's own env.eval, so there it must build, and the one-line error names it."""
    import shutil

    import jax

    from posttrain.runs import read as read_run

    run = tmp_path / "mine"
    shutil.copytree(run_dir, run)
    raw = json.loads((run / "config.json").read_text())
    mine = {"words": {"id": "no_such_envs_module:WordLength-v0", "weight": 1.0, "kwargs": {"split": "test"}}}
    raw["env"].update(train=mine, eval=mine)
    (run / "config.json").write_text(json.dumps(raw))
    assert main("--suite=configs/eval/tiny.py", f"--checkpoint={run}", "--domains=arithmetic", "--limit=2",
                f"--out={tmp_path / 'report'}") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records, results = records_lib.read_evaluation(tmp_path / "report" / "candidate")
    assert [r["domain"] for r in records] == ["arithmetic"] * 2 and results["task_set_hash"] == result["task_set_hash"]
    assert main(f"--checkpoint={run}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: env.eval.words: id='no_such_envs_module:WordLength-v0' kwargs={'split': 'test'}: "
                              "ModuleNotFoundError: No module named 'no_such_envs_module'"), err
    model_config, state, tokenizer = grpo.run_policy(make_run_plan(evaluate.reading_config(run), workdir=str(run)))
    assert tokenizer.vocab_size <= model_config.vocab_size and len(jax.tree.leaves(state)) > 0


def _power_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_power", ROOT / "scripts/eval_power.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~25 s alone (100 s on a loaded machine); the default suite runs --pool on a scripted pool
def test_power_script_quick_mode_measures_a_pool_and_the_pool_measures_again(run_dir, tmp_path, capsys):
    """scripts/eval_power.py --quick (issue 22 acceptance 3) on this module's step-0 run: a pool of 2 x 3 samples
    per task on 6 arithmetic tasks, A/A over 3 seed pairs, the planted constant rescored; the written pool
    (--pool, no sampling) gives the same figures. The default suite covers the script's measurement by --pool on
    a scripted pool (tests/posttrain/eval/test_eval_power.py) and its sampling path (`evaluate.evaluate_policies`)
    by test_suite_against_base_writes_the_report_and_rescoring_reproduces_it."""
    script = _power_script()
    out = script.main(["--quick", "--json", f"--checkpoint={run_dir}", f"--out={tmp_path}"])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == out
    assert out["domains"] == ["arithmetic"] and out["tasks"] == {"arithmetic": 6} and out["samples_per_task"] == 6
    assert out["seeds"] == 3 and len(out["aa_pass_at_1"]["arithmetic"]) == 3 and out["temperature"] == 1.0
    assert 0.0 <= out["false_alarm_rate"] <= 1.0 and out["planted_domain"] == "arithmetic"
    assert out["planted_pass_at_1"] == [0.0] * 3  # the constant -987654321 answers no addition
    assert "A/A false-alarm rate" in printed and "planted regression on arithmetic" in printed
    pool = tmp_path / "pool"
    assert (pool / "records.jsonl").is_file() and (pool / "results.json").is_file()
    again = script.main(["--quick", f"--pool={pool}"])
    capsys.readouterr()
    for key in ("false_alarms", "aa_pass_at_1", "detected", "planted_pass_at_1", "pool_pass_at_1"):
        assert again[key] == out[key], key


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint=x", "--temperature=0"], "--temperature > 0"),
    (["--seeds=3"], "give --checkpoint=RUN"),
])
def test_power_script_bad_arguments_are_one_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _power_script().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


BROKEN_ENV = '''
import gymnasium
from envs import base


class Broken(base.QuestionAnswerEnv):
    """Its verifier raises on every reply (a bug in user code): every sample ends as infra_error."""
    instruction = "Answer with a number."

    def __init__(self, split="test"):
        tasks = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "id": i} for i in range(4)]
        super().__init__(base.ListTaskSource(tasks, split=split, name="broken"), max_turns=1, self_check=False)

    def turn_step(self, action):
        raise ZeroDivisionError("verifier bug")


gymnasium.register("Broken-v0", entry_point=Broken)
'''
BROKEN_SUITE = '''
def get_suite():
    arithmetic = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20},
                  "scorer": "last_integer", "format": "number"}
    return {"name": "broken", "defaults": {"split": "test", "tasks": 4, "max_new_tokens": 6},
            "areas": {"a": {"domains": {"arithmetic": arithmetic, "broken": {"env": "broken_env:Broken-v0"}}}}}
'''


def test_a_domain_whose_env_fails_every_sample_is_unscored_not_zero(run_dir, tmp_path, monkeypatch, capsys):
    """A user trial's suite whose env raised in step reported pass@1 0.000, "no change" and exit code 0. Its
    samples are infra errors: the domain is UNSCORED in each table, left out of the pairs (named under the
    comparison), the other domains are compared as usual, and the command exits 1 naming it."""
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    (tmp_path / "suite.py").write_text(BROKEN_SUITE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "report"
    assert main(f"--suite={tmp_path / 'suite.py'}", f"--checkpoint={run_dir}", "--baseline=base",
                f"--out={out}") == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        "error: no task of these domains was scored, every sample ended in infra_error (the env or its sandbox "
        "failed; the records' reasons say why): baseline: broken; candidate: broken")
    assert "| - broken UNSCORED | 0 | 0 | - |" in captured.out
    assert "broken: every task (not tested)" in captured.out
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["counts"] == {"improved": 0, "no change": 1, "regressed": 0}  # arithmetic alone is compared
    assert result["unscored"] == {"baseline": ["broken"], "candidate": ["broken"]}
    records, results = records_lib.read_evaluation(out / "candidate")
    broken = [r for r in records if r["domain"] == "broken"]
    assert len(broken) == 4 and all(r["statuses"] == ["infra_error"] for r in broken)
    assert results["summary"]["domains"]["broken"] == {"tasks": 0, "n_min": 0, "infra_errors": 4, "unscored_tasks": 4}
