"""scripts/compare_commits.py's comparisons on small synthetic run folders (no training run, no JAX)."""
import importlib.util
import json
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "compare_commits.py"
_spec = importlib.util.spec_from_file_location("compare_commits", _PATH)
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

ROWS = [{"step": 0, "eval/pass@1": 0.25, "perf/eval_s": 3.0},
        {"step": 1, "policy/loss": 0.5, "reward/mean": 0.0, "env/timeout_rate": 0.0, "frac_zero_std_groups": 1.0,
         "tasks/arithmetic/cpu_s": 0.01, "perf/step_s": 1.0, "perf/tokens_per_s": 10.0},
        {"step": 2, "policy/loss": 0.25, "reward/mean": 0.5, "optim/lr": 1e-3, "perf/peak_rss_gb": 1.0}]


def _manifest(step: int, sums) -> dict:
    return {"format": 1, "step": step, "leaves": [
        {"path": "step", "shape": [], "dtype": "int32", "checksum": [step, step]},
        {"path": "params/w/value", "shape": [2, 3], "dtype": "float32", "checksum": list(sums)}]}


def _write_run(d: pathlib.Path, rows=ROWS, sums=(11, 22), reward=(0.0, 1.0), sampler_s=(0.1, 0.2)):
    """A run folder with what a tiny GRPO run writes that the tool compares (no arrays: manifests only)."""
    (d / "archive").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({"episode_id": ["a", "b"], "completion_ids": [[1, 2], [3]], "reward": list(reward),
                      "sampler_s": list(sampler_s)})
    pq.write_table(table, d / "archive" / "step_00000000.parquet")
    for step in (2, 4):
        for item, value in (("manifest", _manifest(step, sums)), ("meta", {"scheduler": {"seed": 0}})):
            (d / "checkpoints" / str(step) / item).mkdir(parents=True, exist_ok=True)
            (d / "checkpoints" / str(step) / item / "metadata").write_text(json.dumps(value))
    (d / "config.json").write_text(json.dumps({"train": {"workdir": str(d), "steps": 4}}))
    (d / "summary.json").write_text(json.dumps({"end_step": 4, "train_wall_s": 9.0, "config": {"x": str(d)}}))
    return d


@pytest.fixture
def runs(tmp_path):
    return _write_run(tmp_path / "old" / "tiny"), tmp_path / "new" / "tiny"


def test_identical_runs_pass_with_their_own_paths_and_timings_aside(runs):
    old, new = runs
    times = [{k: (v * 7 if cc.is_timing(k) else v) for k, v in r.items()} for r in ROWS]
    _write_run(new, rows=times, sampler_s=(5.0, 6.0))
    r = cc.compare_run(old, new)
    assert r["identical"], r["differences"]
    assert r["compared"]["metrics"]["values"] == 11 and r["compared"]["metrics"]["timing_skipped"] == 5
    assert r["compared"]["parquet"]["cells"] == 6 and r["compared"]["parquet"]["timing_skipped"] == ["sampler_s"]
    assert r["compared"]["checkpoints"]["steps"] == [2, 4] and r["compared"]["checkpoints"]["arrays"] == 4


def test_timing_keys():
    timing = ["perf/step_s", "perf/idle_ratio_train", "train_wall_s", "peak_rss_gb", "tasks/arithmetic/cost_s",
              "eval_start/perf/eval_s", "sampler_s", "wall_time"]
    kept = ["env/timeout_rate", "frac_zero_std_groups", "rollout/resample_rounds", "sft/ppl", "step", "reward/std"]
    assert [k for k in timing if not cc.is_timing(k)] == [] and [k for k in kept if cc.is_timing(k)] == []


def test_a_changed_metric_names_its_step_and_key(runs):
    old, new = runs
    _write_run(new, rows=ROWS[:2] + [{**ROWS[2], "policy/loss": 0.2500001}])
    r = cc.compare_run(old, new)
    assert not r["identical"] and r["compared"]["metrics"]["differences"] == 1
    assert r["differences"] == ["metrics.jsonl: row 2 (step 2): key 'policy/loss': 0.25 != 0.2500001"]


def test_an_int_for_a_float_a_missing_key_and_a_missing_row_differ(runs):
    old, new = runs
    _write_run(new, rows=[ROWS[0], {k: v for k, v in ROWS[1].items() if k != "reward/mean"}])
    diffs = cc.compare_metrics(old, new)[1]
    assert diffs[0] == "metrics.jsonl: 3 rows in old, 2 in new" and "'reward/mean' only in old" in diffs[1]
    assert not cc.same(1, 1.0) and cc.same(float("nan"), float("nan")) and cc.same([1.5, {"a": 2}], [1.5, {"a": 2}])


def test_an_archive_cell_differs(runs):
    old, new = runs
    _write_run(new, reward=(0.0, 0.5))
    r = cc.compare_run(old, new)
    assert r["differences"] == ["archive/step_00000000.parquet: column 'reward' row 1: 1.0 != 0.5"]


def test_a_missing_archive_file_differs(runs):
    old, new = runs
    _write_run(new)
    (new / "archive" / "step_00000000.parquet").unlink()
    assert cc.compare_parquets(old, new)[1] == ["parquet file archive/step_00000000.parquet only in old"]


def test_a_checkpoint_checksum_or_step_differs(runs):
    old, new = runs
    _write_run(new, sums=(11, 23))
    counts, diffs = cc.compare_checkpoints(old, new)
    assert diffs == [f"checkpoints/{s}: params/w/value: checksum [11, 22] != [11, 23]" for s in (2, 4)]
    shutil.rmtree(new / "checkpoints" / "4")
    assert "checkpoint checkpoints/4 only in old" in cc.compare_checkpoints(old, new)[1]
    assert cc.compare_checkpoints(old, new, only=2)[0]["steps"] == [2]


def test_json_files_compare_config_and_summary_without_timing(runs):
    old, new = runs
    _write_run(new)
    (new / "summary.json").write_text(json.dumps({"end_step": 3, "train_wall_s": 1.0, "config": {"x": "y"}}))
    assert cc.compare_json_files(old, new)[1] == ["summary.json: end_step: 4 != 3"]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cc.parse_args(["HEAD", "HEAD", "--runs=tiny,huge"])
    assert e.value.code == 2 and "huge" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.parse_args(["HEAD", "HEAD", "--runs=sft_tiny", "--resume-from=OLD"])
    with pytest.raises(cc.SetupError, match="unknown revision"):
        cc.resolve("no-such-revision-xyz")


def _metrics(d: pathlib.Path, norms) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0}] + [{"step": i + 1, "optim/grad_norm": g, "policy/loss": 0.0} for i, g in enumerate(norms)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_a_grad_norm_of_0_at_every_step_is_a_run_that_does_not_learn(tmp_path):
    old, new = _metrics(tmp_path / "old", [0.0, 0.0, 0.0]), _metrics(tmp_path / "new", [0.0, 1.25, 0.0])
    info, diffs = cc.learning(old, new)
    assert not info["learns"] and info["grad_norm"] == {"old": [[1, 0.0], [2, 0.0], [3, 0.0]],
                                                        "new": [[1, 0.0], [2, 1.25], [3, 0.0]]}
    assert diffs == ["old: optim/grad_norm is 0 or absent at every step (3 rows have it): no update"]
    r = cc.with_learning({"identical": True, "compared": {}, "n_differences": 0, "differences": []}, old, new)
    assert not r["identical"] and r["n_differences"] == 1 and r["learns"] is False
    _metrics(old, [0.5, 0.0, 0.0])
    assert cc.learning(old, new) == ({"learns": True, "grad_norm": {"old": [[1, 0.5], [2, 0.0], [3, 0.0]],
                                                                    "new": [[1, 0.0], [2, 1.25], [3, 0.0]]}}, [])
    (new / "metrics.jsonl").write_text(json.dumps({"step": 1, "policy/loss": 0.0}) + "\n")  # no grad_norm at all
    assert not cc.learning(old, new)[0]["learns"]


def test_a_reward_model_export_and_paths_into_the_side_folder(tmp_path):
    for side, byte in (("old", b"\0"), ("new", b"\0")):
        run = tmp_path / side / "rm"
        (run / "reward_model").mkdir(parents=True)
        (run / "reward_model" / "model.safetensors").write_bytes(byte * 8)
        (run / "reward_model" / "config.json").write_text(json.dumps({"hidden_size": 64}))
        tiny = tmp_path / side / "tiny_rm"
        tiny.mkdir()
        (tiny / "config.json").write_text(json.dumps({"rewards": {"model": f"{tmp_path / side}/rm"}}))
    old, new = tmp_path / "old", tmp_path / "new"
    assert cc.compare_export(old / "rm", new / "rm") == ({"files": 2, "json_values": 1, "hashed": 1}, [])
    assert cc.compare_json_files(old / "tiny_rm", new / "tiny_rm")[1] == []
    (new / "rm" / "reward_model" / "model.safetensors").write_bytes(b"\1" * 8)
    (new / "rm" / "reward_model" / "config.json").write_text(json.dumps({"hidden_size": 32}))
    diffs = cc.compare_export(old / "rm", new / "rm")[1]
    assert diffs[0] == "reward_model/config.json: hidden_size: 64 != 32" and "model.safetensors: sha256" in diffs[1]


def test_tiny_rm_runs_after_the_reward_model_it_reads(tmp_path):
    assert cc.parse_args(["A", "B", "--runs=tiny_rm,tiny"]).runs == ["rm", "tiny_rm", "tiny"]
    assert cc.parse_args(["A", "B"]).runs == list(cc.RUNS)
    args = cc.parse_args(["A", "B", "--runs=tiny_rm", "--extra-new-runs=tiny_rm"])
    assert args.extra_new_runs == ["tiny_rm"] and cc.parse_args(["A", "B", "--runs=rm"]).extra_new_runs == ["rm"]
    with pytest.raises(SystemExit):
        cc.parse_args(["A", "B", "--runs=rm", "--extra-new-runs=tiny"])
    assert cc.run_args("tiny_rm", tmp_path)[-1] == f"--config.rewards.model={tmp_path}/rm"
