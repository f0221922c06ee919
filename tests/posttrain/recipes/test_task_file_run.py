"""Task files end to end on the tiny model: train on a JSONL file and evaluate on a CSV file with only a config, export
the run's episodes as a task file and check it, and a private suite domain read from a task file giving the report
and verdicts of the built-in domain holding the same tasks."""
import csv
import json

import pytest
from absl.testing import flagsaver

from envs.tasks.arithmetic import ArithmeticTasks
from posttrain import cli
from posttrain.recipes import evaluate

CONFIG = """
from posttrain.config.tiny import tiny_base


def get_config():
    c = tiny_base("tiny-dense", workdir="unused")
    c.env.train = {{"add": {{"path": {train!r}, "kwargs": {{"verifier": "math"}}}}}}
    c.env.eval = {{"add": {{"path": {held_out!r}, "kwargs": {{"split": "all", "verifier": "math"}}}}}}
    c.train.steps = 2
    return c
"""


def main(*args):
    with flagsaver.flagsaver():  # absl flags keep their values between in-process calls
        return cli.main(["posttrain", *args])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, folder of the files, the train command's JSON line) of a 2-step run on a JSONL and a CSV file."""
    d = tmp_path_factory.mktemp("taskfile")
    train = ArithmeticTasks("train", digits=1, num_test=20)
    with open(d / "train.jsonl", "w") as f:
        for i in range(60):
            t = train.get_task(i)
            row = {"id": t["id"], "prompt": t["question"], "answer": t["answer"], "split": "train", "topic": "sums"}
            f.write(json.dumps({**row, "system": "Answer with a number."} if i % 2 else row) + "\n")
    test = ArithmeticTasks("test", digits=1, num_test=20)
    with open(d / "held_out.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "prompt", "answer"])
        writer.writeheader()
        writer.writerows({"id": t["id"], "prompt": t["question"], "answer": t["answer"]}
                         for t in map(test.get_task, range(20)))
    (d / "cfg.py").write_text(CONFIG.format(train=str(d / "train.jsonl"), held_out=str(d / "held_out.csv")))
    workdir = d / "run"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main("train", f"--config={d / 'cfg.py'}", f"--workdir={workdir}", "--noprogress")
    assert code == 0
    return workdir, d, json.loads(out.getvalue().strip().splitlines()[-1])


def test_a_run_trains_on_a_jsonl_file_and_evaluates_on_a_csv_file(run):
    from posttrain.scheduling import archive

    workdir, _, summary = run
    assert summary["end_step"] == 2 and summary["eval_end"] is not None
    rows = archive.read(workdir).to_pylist()
    assert rows and {r["domain"] for r in rows} == {"add"}
    # metrics.jsonl and the archive join on archive_step: update k+1 trained the batch the archive calls step k
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    trained = {int(m["step"]): int(m["archive_step"]) for m in metrics if m.get("archive_step") is not None}
    assert trained == {1: 0, 2: 1} and {r["step"] for r in rows if r["in_batch"]} == set(trained.values())
    assert all(r["task_id"].startswith("arithmetic-train-") for r in rows)  # the file's ids, train rows only


def test_export_writes_the_archived_tasks_as_a_task_file_that_passes_the_check(run, capsys):
    workdir, d, _ = run
    out = d / "export.jsonl"
    assert main("tasks", "export", f"--from_archive={workdir}", f"--out={out}") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train = {json.loads(line)["id"]: json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()}
    for r in rows:  # the prompt as the env held it: a row's own system prompt kept, its other fields too
        source = train[r["metadata"]["task_id"]]
        want = ([{"role": "system", "content": source["system"]}, {"role": "user", "content": source["prompt"]}]
                if "system" in source else source["prompt"])
        assert r["prompt"] == want and r["topic"] == "sums"
    assert rows and any(isinstance(r["prompt"], list) for r in rows)
    assert all(r["answer"] == train[r["metadata"]["task_id"]]["answer"] for r in rows)
    assert all(r["metadata"]["episodes"] == len(r["metadata"]["rewards"]) >= 1 for r in rows)
    capsys.readouterr()
    assert main("tasks", "check", str(out), "--json") == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["files"][0]["rows"] == len(rows)
    assert main("tasks", "export", f"--from_archive={workdir}", f"--out={d / 'none.jsonl'}", "--min_reward=2") == 2


SUITE = """
def get_suite():
    return {{"name": "private", "defaults": {{"tasks": 20, "temperature": 0.0, "max_new_tokens": 6}},
            "areas": {{"arithmetic": {{"domains": {{
                "builtin": {{"env": "posttrain/Arithmetic-v0", "kwargs": {{"digits": 1, "num_test": 20}}}},
                "private": {{"path": {path!r}, "kwargs": {{"verifier": "math"}}}},
            }}}}}}}}
"""


def test_a_private_suite_domain_from_a_task_file_reports_as_the_builtin_domain(run, capsys):
    workdir, d, _ = run
    test = ArithmeticTasks("test", digits=1, num_test=20)
    with open(d / "private.jsonl", "w") as f:
        for i in range(20):
            t = test.get_task(i)
            f.write(json.dumps({"id": t["id"], "prompt": t["question"], "answer": t["answer"]}) + "\n")
    (d / "suite.py").write_text(SUITE.format(path=str(d / "private.jsonl")))
    out = d / "report"
    assert main("eval", f"--suite={d / 'suite.py'}", f"--checkpoint={workdir}", "--baseline=base",
                f"--out={out}") == 0
    # the same policy's replies: the same records and rows in both domains (the floors are each domain's own)
    records = [json.loads(line) for line in (out / "candidate" / "records.jsonl").read_text().splitlines()]
    by_domain = {name: [r for r in records if r["domain"] == name] for name in ("builtin", "private")}
    assert [(r["task_id"], r["prompt"], r["replies"], r["rewards"]) for r in by_domain["builtin"]] == \
        [(r["task_id"], r["prompt"], r["replies"], r["rewards"]) for r in by_domain["private"]]
    assert by_domain["private"][0]["floor"] is not None
    # a candidate that solves half the tasks, rescored through each domain's own env: the same verdicts and figures
    for r in records:
        if r["index"] % 2 == 0:
            r["replies"] = [f"The answer is {r['gold']}."]
    (out / "candidate" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rescored = evaluate.rescore_folder(str(out))
    assert rescored["counts"]["improved"] == 2
    rows = {r["domain"]: r for r in json.loads((out / "rescored" / "comparison.json").read_text())["domains"]}
    assert rows["builtin"]["pass@1"]["candidate"] == 0.5
    assert {k: v for k, v in rows["builtin"].items() if k != "domain"} == \
        {k: v for k, v in rows["private"].items() if k != "domain"}


def test_rows_graded_by_a_model_the_run_lacks_are_refused_before_training(tmp_path):
    from posttrain.config import ConfigError
    from posttrain.config.plan import check_model_graded
    from posttrain.rollout.env_side import EnvSpec, task_sources
    from posttrain.rollout.rewards import RewardsConfig

    rows = [{"prompt": "Describe a cat.", "rubric": [{"name": "vivid", "weight": 1, "description": "vivid"}],
             "verifier": "rubric"}, {"prompt": "2+2?", "answer": "4"}]
    path = tmp_path / "graded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = task_sources({"graded": EnvSpec(path=str(path), kwargs={"split": "all"})})
    with pytest.raises(ConfigError, match=r"env.train.graded: .*\['rubric'\].*rewards.judge.enabled"):
        check_model_graded(sources, RewardsConfig())
