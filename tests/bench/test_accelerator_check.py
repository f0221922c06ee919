"""scripts/accelerator_check.py: its --dry-run (every step at tiny shapes on the CPU, the `accelerator_dry_run`
fixture) writes the same files with the same keys as a real run; the real-mode arguments parse in each bench;
--only keeps the other steps' files; the budget, a step's timeout, the wheel install and the JUnit reading.

The --quick modes of the four benches the check runs (attention, grpo_step, moe, rollout) are checked here, on the
dry run's JSON, like the other benches' in test_quick_modes.py: the figure, its peer and their ratio. They live in
this file so that the dry run (~60 s) runs once per suite: a session fixture runs once per xdist worker, and
`--dist loadfile` put the two files on different workers."""
import json
import os
import pathlib
import shutil
import sys
import time
import tomllib
import zipfile

import numpy as np
import pytest
from helpers import json_value, load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


check = load_script(ROOT / "scripts" / "accelerator_check.py", "accelerator_check")


def _has(obj, path: str) -> bool:
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return False
        obj = obj[key]
    return True


def test_dry_run_writes_every_step_file_with_its_keys(accelerator_dry_run):
    run = accelerator_dry_run
    assert run.returncode == 0, run.stderr[-4000:]
    files = sorted(p.name for p in run.out.iterdir())
    assert files == sorted([f"{s}.json" for s in check.STEPS] + ["summary.json"]) and len(files) <= 8
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["dry_run"] and list(summary["steps"]) == list(check.STEPS) and summary["setup"]["missing"] == []
    for name, step in check.STEPS.items():
        record = json.loads((run.out / f"{name}.json").read_text())
        assert record["status"] == "ok" and record["dry_run"] and record["seconds"] <= record["timeout_s"], record
        precision = "highest" if name == "tests" else "default"  # the tests' own; the benches' the product's
        assert record["env"]["JAX_DEFAULT_MATMUL_PRECISION"] == precision and record["env"]["JAX_PLATFORMS"] == "cpu"
        assert [k for k in step.keys if not _has(record["result"], k)] == [], name
        assert summary["steps"][name]["status"] == "ok" and set(step.keys) <= set(summary["steps"][name])
    tests = json.loads((run.out / "tests.json").read_text())["result"]
    assert tests["collected"] == tests["passed"] == len(check.DRY_TESTS) and tests["failures"] == []
    for remat in ("dots", "full"):
        grpo = json.loads((run.out / f"grpo_step_{remat}.json").read_text())["result"]
        assert grpo["remat"] == remat and grpo["dtype"] == "bfloat16" and grpo["finite"] and grpo["peak_gib"] > 0
        assert grpo["device"] == "cpu" and grpo["mfu_published_peak"] is None  # no published peak for a CPU
    rollout = json.loads((run.out / "rollout.json").read_text())["result"]
    assert rollout["ignore_stop"] and rollout["dtype"] == "float32" and rollout["torch_device"] == "cpu"


def _attention(out):
    assert set(out["results"]) == {"blockwise", "dense"}  # the fused kernels only on their own platform
    bench = load_script(ROOT / "bench" / "attention.py", "check_attention")
    args = bench.parse_args(["--quick"])  # the quick row: its allowed pairs, counted by brute force
    seg, br = bench.row_ids(args)
    i, j = np.arange(args.row_len)[:, None], np.arange(args.row_len)[None, :]
    mask = (j <= i) & (seg[:, None] == seg[None, :]) & ((br[None, :] == 0) | (br[:, None] == br[None, :]))
    assert out["flops_per_step"] == 3 * 4 * args.head_dim * args.heads * int(mask.sum()) * args.rows


def _grpo_step(out):
    assert (out["rows"], out["row_len"], out["tokens_per_step"]) == (2, 48, 96) and out["finite"]
    assert out["model_flops_per_step"] > 6 * out["active_params"] * out["tokens_per_step"]  # + head + attention


def _moe(out):
    assert set(out["results"]) == {"dense", "ragged", "padded", "capacity"}  # megablox only on a TPU
    assert all(r["ratio_to_dense"] > 0 and r["peak_gib"] >= 0 for r in out["results"].values())


def _rollout(out):
    assert out["outputs_agreeing"] == out["rows"] == 2 * out["prompts"] == 8  # same weights, greedy: same tokens
    assert out["tokens_counted"]["posttrain"] == out["tokens_counted"]["transformers"]
    assert out["outputs_changed_between_runs"] == {"posttrain": 0, "transformers": 0}  # float32 on the CPU


# bench: (the check's step that ran its --quick mode, figure, peer, ratio (keys, dotted), more checks)
QUICK = {
    "attention": ("attention", "results.dense.tokens_per_s", "results.blockwise.tokens_per_s",
                  "results.dense.ratio_to_blockwise", _attention),
    "grpo_step": ("grpo_step_dots", "model_flops_per_s", "peak_flops_per_s", "mfu", _grpo_step),
    "moe": ("moe", "results.padded.tokens_per_s", "results.dense.tokens_per_s", "results.padded.ratio_to_dense", _moe),
    "rollout": ("rollout", "posttrain_tokens_per_s", "transformers_tokens_per_s", "ratio", _rollout),
}


def _quick_result(run, name: str) -> dict:
    record = json.loads((run.out / f"{QUICK[name][0]}.json").read_text())
    assert record["status"] == "ok" and "--quick" in record["command"], record
    return record["result"]


def test_the_benches_the_check_runs_are_the_quick_table():
    assert {pathlib.Path(s.args[0]).stem for s in check.STEPS.values() if s.args[0].startswith("bench/")} == set(QUICK)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_reports_the_figure_its_peer_and_their_ratio(name, accelerator_dry_run):
    _, figure, peer, ratio, more = QUICK[name]
    out = _quick_result(accelerator_dry_run, name)
    values = [json_value(out, k) for k in (figure, peer, ratio)]
    assert all(isinstance(v, (int, float)) and v > 0 for v in values), dict(zip((figure, peer, ratio), values))
    more(out)


def test_moe_runs_only_the_variants_that_fit(accelerator_dry_run, capsys):
    peaks = {k: r["peak_gib"] for k, r in _quick_result(accelerator_dry_run, "moe")["results"].items()}
    assert peaks["ragged"] > 2 * peaks["dense"] > 0  # XLA:CPU's ragged_dot expands across the groups
    budget = 2 * peaks["dense"] / 0.9  # `aot.fits` takes 90% of it: dense fits, ragged does not
    out = load_script(ROOT / "bench" / "moe.py", "check_moe").main(["--quick", "--json", "--impls", "ragged",
                                                              "--max-gib", str(budget)])
    capsys.readouterr()
    assert "step_s" in out["results"]["dense"] and "step_s" not in out["results"]["ragged"]
    assert out["memory_budget_gib"] == pytest.approx(budget, rel=1e-3)
    assert out["results"]["ragged"]["skipped"] == (f"needs {peaks['ragged']} GiB, more than fits in "
                                                   f"{out['memory_budget_gib']} GiB")


def test_real_mode_arguments_parse_in_each_bench():
    def real(name):
        return check.step_command(name, dry_run=False, work="W")[2:]  # after the interpreter and the script

    grpo = load_script(ROOT / "bench" / "grpo_step.py", "check_grpo_step")
    for remat in ("dots", "full"):
        a = grpo.parse_args(real(f"grpo_step_{remat}"))
        cfg, _ = grpo.model_config(a, "gpu")
        assert (a.model, a.remat, cfg.dtype, cfg.param_dtype) == ("qwen3-0.6b", remat, "bfloat16", "float32")
        assert grpo.make_batch(a, cfg, None).tokens_RxL.shape == (16, 2176)
    a = load_script(ROOT / "bench" / "moe.py", "check_moe").parse_args(real("moe"))
    assert (a.tokens, a.d_model, a.experts, a.top_k, a.expert_mlp, a.quick) == (16384, 2048, 128, 8, 768, False)
    a = load_script(ROOT / "bench" / "rollout.py", "check_rollout").parse_args(real("rollout"))
    assert (a.model, a.prompts, a.group, a.prompt_len, a.new_tokens) == ("qwen3-0.6b", 512, 1, 128, 256)
    assert a.ignore_stop and a.dtype == "bfloat16" and a.no_floor and a.profile and not a.quick
    a = load_script(ROOT / "bench" / "_rollout_long_tail.py", "check_long_tail").parse_args(real("engine"))
    assert (a.model, a.requests, a.slots, a.short, a.prompt_len, a.runs) == ("qwen3-0.6b", 256, 128, 32, 128, 1)
    assert a.skip_transformers and a.profile and not a.quick
    a = load_script(ROOT / "bench" / "attention.py", "check_attention").parse_args(real("attention"))
    assert (a.rows, a.row_len, a.prompt_len, a.group, a.quick) == (4, 16384, 2048, 8, False)
    tests = check.step_command("tests", dry_run=False, work="W")
    assert tests[tests.index("-m", 3) + 1] == "kernel or parity" and tests[-1] == "tests"
    assert tests[tests.index("-n") + 1] == "8" and "--continue-on-collection-errors" in tests
    tests = check.step_command("tests", dry_run=False, work="W", tests_marker="kernel")
    assert tests[tests.index("-m", 3) + 1] == "kernel"
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= {"parity", "kernel"}  # registered for `pytest -m`


def test_only_reruns_the_chosen_steps_and_keeps_the_others(accelerator_dry_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(accelerator_dry_run.out, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fake = {"step": "moe", "status": "ok", "seconds": 1.0, "dry_run": True, "result": {"platform": "fake"}}
    monkeypatch.setattr(check, "run_step", lambda name, *a: dict(fake, step=name))
    assert check.main(["--dry-run", "--only", "moe", "--out", str(out), "--cache-dir", str(tmp_path / "c")]) == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    changed = sorted(n for n in after if after[n] != before[n])
    assert set(after) == set(before) and changed == ["moe.json", "summary.json"]
    summary = json.loads(after["summary.json"])
    assert list(summary["steps"]) == list(check.STEPS) and summary["steps"]["moe"]["platform"] == "fake"
    assert summary["steps"]["tests"] == json.loads(before["summary.json"])["steps"]["tests"]


def test_a_budget_too_small_skips_the_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "run_step", lambda *a: pytest.fail("no step fits in the budget"))
    argv = ["--only", "tests,moe", "--budget-s", "12", "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path)]
    assert check.main(argv) == 1
    for name in ("tests", "moe"):
        record = json.loads((tmp_path / "o" / f"{name}.json").read_text())
        assert record["status"] == "skipped" and "left in the budget" in record["reason"]


def test_a_step_past_its_timeout_is_interrupted_and_keeps_its_output(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "GRACE_S", 2.0)  # the child's KeyboardInterrupt within the grace, under load too
    t = time.perf_counter()
    rc, out, err, _ = check.run_process([sys.executable, "-c", "import time; print('started', flush=True); "
                                         "time.sleep(60)"], dict(os.environ), 1.0, str(tmp_path))
    assert rc is None and out == "started\n" and "KeyboardInterrupt" in err  # SIGINT first
    stubborn = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('x', flush=True); "
                "time.sleep(60)")
    rc, out, _, seconds = check.run_process([sys.executable, "-c", stubborn], dict(os.environ), 1.0, str(tmp_path))
    assert rc is None and out == "x\n" and seconds < 5 and time.perf_counter() - t < 10  # then SIGKILL


def test_junit_counts_and_failures(tmp_path):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1" time="2.5">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad">'
        '<failure message="assert 1 == 2&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="boom">tb</error></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped message="no gpu"/></testcase>'
        '</testsuite></testsuites>')
    r = check.junit_result(str(tmp_path / "j.xml"))
    assert (r["collected"], r["passed"], r["failed"], r["errors"], r["skipped"], r["seconds"]) == (4, 1, 1, 1, 1, 2.5)
    assert r["failures"] == [{"test": "tests.a::test_bad", "message": "assert 1 == 2"},
                             {"test": "tests.b::test_err", "message": "boom"}]
    assert check.junit_result(str(tmp_path / "absent.xml")) is None and r["collection_errors"] == []


def test_junit_lists_modules_that_failed_to_import_apart(tmp_path):
    # what pytest --continue-on-collection-errors wrote on the H200, whose image has no ray (tests/ collected whole)
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="1" skipped="1" time="12.1">'
        '<testcase classname="" name="tests.posttrain.rollout.test_ray_runner">'
        '<error message="collection failure">ImportError while importing test module\n'
        "E   ModuleNotFoundError: No module named 'ray'</error></testcase>"
        '<testcase classname="tests.m" name="test_ok"/>'
        '<testcase classname="tests.m" name="test_skip"><skipped message="no gguf"/></testcase>'
        '</testsuite></testsuites>')
    r = check.junit_result(str(tmp_path / "j.xml"))
    assert (r["collected"], r["passed"], r["failed"], r["errors"], r["skipped"]) == (2, 1, 0, 0, 1)
    assert r["failures"] == [] and r["collection_errors"] == [
        {"module": "tests.posttrain.rollout.test_ray_runner", "message": "E   ModuleNotFoundError: No module named 'ray'"}]


def _probe_wheel(folder: pathlib.Path) -> None:
    """A minimal pure-Python wheel of `posttrain-check-probe` 0.1 (module posttrain_check_probe)."""
    info = "posttrain_check_probe-0.1.dist-info"
    files = {"posttrain_check_probe/__init__.py": "VALUE = 1\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: posttrain-check-probe\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / "posttrain_check_probe-0.1-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)


def test_missing_wheels_install_from_the_folder_once(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _probe_wheel(wheels)
    monkeypatch.setattr(check, "WHEELS", ("posttrain-check-probe", "pytest"))  # pytest: present, not installed
    record = check.install_wheels(str(wheels), str(site), 120)
    assert record["missing"] == record["installed"] == ["posttrain-check-probe"], record
    assert record["pip_returncode"] == 0 and (site / "posttrain_check_probe" / "__init__.py").exists()
    again = check.install_wheels(str(wheels), str(site), 120)
    assert again["missing"] == [] and again["pip_returncode"] is None
    nowhere = check.install_wheels("", str(tmp_path / "empty"), 120)
    assert nowhere["missing"] == ["posttrain-check-probe"] and "no --wheels" in nowhere["warning"]


@pytest.mark.parametrize("argv, message", [(["--only", "tests,nope"], "unknown step"),
                                           (["--wheels", "/no/such/folder"], "is not a folder")])
def test_bad_arguments_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        check.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_variant_whose_compile_runs_out_of_memory_is_skipped_and_the_others_run(monkeypatch, capsys):
    # the H200's first run: XLA's autotuner asked for 128 GiB compiling moe "ragged", and the bench died
    from posttrain.infra import aot

    real, calls = aot.compile_with_report, []

    def compile_with_report(lowered, top=5):  # compiled in the order dense (the peer), ragged, padded
        calls.append(1)
        if len(calls) == 2:
            raise __import__("jax").errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Failed to get configs for: 4 out of 33 instructions.\nOut of memory")
        return real(lowered, top)

    monkeypatch.setattr(aot, "compile_with_report", compile_with_report)
    out = load_script(ROOT / "bench" / "moe.py", "check_moe_oom").main(["--quick", "--json",
                                                                         "--impls", "ragged,padded"])
    capsys.readouterr()
    assert out["results"]["ragged"]["skipped"] == ("compile ran out of device memory: RESOURCE_EXHAUSTED: Failed "
                                                   "to get configs for: 4 out of 33 instructions.")
    assert "step_s" in out["results"]["dense"] and "step_s" in out["results"]["padded"]

    def other_error(lowered, top=5):
        raise __import__("jax").errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(aot, "compile_with_report", other_error)
    with pytest.raises(__import__("jax").errors.JaxRuntimeError, match="INTERNAL"):  # only memory is skipped
        load_script(ROOT / "bench" / "moe.py", "check_moe_oom2").main(["--quick", "--json"])


def test_tests_pass_when_the_only_import_failures_are_packages_the_image_lacks():
    # the H200 run of 2e4bc17: 75 passed, 5 skipped, ray and nbformat absent there; pytest exited 1
    absent = [{"module": "tests.posttrain.rollout.test_ray_runner", "message": "E   ModuleNotFoundError: No module named 'ray'"},
              {"module": "tests.test_notebooks", "message": "E   ModuleNotFoundError: No module named 'nbformat'"}]
    run = {"collected": 80, "passed": 75, "failed": 0, "errors": 0, "skipped": 5, "failures": [],
           "collection_errors": absent}
    assert check.step_status("tests", 1, run) == "ok"
    assert check.step_status("tests", 0, {**run, "collection_errors": []}) == "ok"
    assert check.step_status("tests", 1, {**run, "collection_errors": []}) == "failed"  # exit 1 with nothing listed
    assert check.step_status("tests", 1, {**run, "failed": 1}) == "failed"
    ours = {"module": "tests.posttrain.test_x", "message": "E   ModuleNotFoundError: No module named 'posttrain.gone'"}
    syntax = {"module": "tests.posttrain.test_y", "message": "E   SyntaxError: invalid syntax"}
    for blocker in (ours, syntax):
        assert check.collection_blockers({"collection_errors": [*absent, blocker]}) == [blocker]
        assert check.step_status("tests", 1, {**run, "collection_errors": [*absent, blocker]}) == "failed"
    assert check.step_status("tests", 5, {**run, "collected": 0, "collection_errors": []}) == "empty"
    assert check.step_status("tests", None, run) == "timeout"
    assert check.step_status("engine", 0, {"ratio": 1.7}) == "ok"
    assert check.step_status("engine", 0, None) == "failed" and check.step_status("engine", 1, {"x": 1}) == "failed"
