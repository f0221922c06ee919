"""`posttrain status --workdir=RUN` (issue 23 item 7): the per-domain view from status.json and the archive, as a
table or JSON, read only; clear errors for a folder that holds no run."""
import json

import pytest

from posttrain import cli as cli_lib
from posttrain.scheduling import archive, status_table
from posttrain.scheduling.tickets import TaskTicket

# (domain, task, status, reward, retry round) of the rows of steps 0 and 1
ROWS = {0: [("a", 0, "ok", 1.0, 0), ("a", 0, "wrong", 0.0, 0), ("b", 1, "infra_error", None, 0),
            ("b", 1, "ok", 0.5, 1)],
        1: [("a", 2, "ok", 1.0, 0), ("a", 2, "ok", 1.0, 0), ("a", 3, "wrong", 0.0, 0), ("a", 3, "ok", 1.0, 0)]}


def make_run(workdir, status=True, pass_threshold=1.0):
    for step, rows in ROWS.items():
        out = []
        for k, (domain, task, st, reward, rnd) in enumerate(rows):
            t = TaskTicket(k, step, "r", domain, task, 0, (k,), attempt=rnd, retry_round=rnd)
            out.append(archive.ticket_row(t, k, policy_version=step, status=st, reward=reward, env_cost_s=0.5))
        archive.write_step(workdir, step, out)
    (workdir / "config.json").write_text(json.dumps({"tasks": {"pass_threshold": pass_threshold}}))
    if status:
        status_table.write_status(workdir, {"version": 1, "step": 1, "steps": 2, "scheduler": "weighted",
                                    "domains": {"a": {"weight": 0.75, "priority": 0, "level": 2},
                                                "b": {"weight": 0.25, "priority": 0, "level": None}}})
    return workdir


def listing(workdir):
    return {str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*")
            if p.is_file()}


def status(capsys, *args):
    code = cli_lib.main(["posttrain", "status", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("with_status, threshold, source, a, b", [
    # status.json (weights, levels) + the archive's counters; a's rows: 6 scored, 4 passes; b: 1 scored of 2
    (True, 1.0, "status.json+archive", dict(weight=0.75, level=2, episodes=6, pass_rate=4 / 6, share_run=0.75),
     dict(weight=0.25, episodes=2, infra_errors=1, retries=1, pass_rate=0.0, share_last=None, share_run=0.25)),
    # no status.json: the archive alone; the run's pass threshold 0.5 makes b's 0.5 a pass
    (False, 0.5, "archive", dict(weight=None, level=None, episodes=6, pass_rate=4 / 6, share_last=1.0),
     dict(pass_rate=1.0, infra_errors=1, share_last=None)),
])
def test_json_view_and_the_run_is_unchanged(tmp_path, capsys, with_status, threshold, source, a, b):
    run = make_run(tmp_path, with_status, threshold)
    before = listing(run)
    code, out, err = status(capsys, f"--workdir={run}", "--json")
    assert code == 0 and err == "" and listing(run) == before
    data = json.loads(out)
    # archive batches 0 and 1 are trained by the updates metrics.jsonl and the checkpoints number 1 and 2
    assert data["step"] == 2 and data["source"] == source and [r["domain"] for r in data["rows"]] == ["a", "b"]
    rows = {r["domain"]: r for r in data["rows"]}
    assert {k: rows["a"][k] for k in a} == pytest.approx(a) and {k: rows["b"][k] for k in b} == pytest.approx(b)


def test_table_view(tmp_path, capsys):
    code, out, _ = status(capsys, f"--workdir={make_run(tmp_path)}")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "step 2 (status.json+archive)"
    assert lines[1].split() == ["domain", "weight", "prio", "share", "last", "share", "run", "quota", "last",
                                "quota", "run", "episodes", "pass", "rate", "infra", "err", "retries", "quarant.",
                                "breaker", "level"]
    assert lines[2].split() == ["a", "0.75", "0", "100.0%", "75.0%", "-", "-", "6", "66.7%", "0", "0", "-", "-", "2"]
    assert lines[3].split() == ["b", "0.25", "0", "-", "25.0%", "-", "-", "2", "0.0%", "1", "1", "-", "-", "-"]


@pytest.mark.parametrize("args, message", [
    ((), "error: status needs --workdir=RUN"),
    (("--workdir={tmp}/nope",), "no such directory"),
    (("--workdir={tmp}",), "neither status.json nor archive/step_*.parquet in it"),
])
def test_no_run_is_one_line_with_exit_code_2(tmp_path, capsys, args, message):
    code, out, err = status(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nope").exists() and list(tmp_path.iterdir()) == []


def test_status_help_lists_its_flags(capsys):
    assert cli_lib.main(["posttrain", "status", "--help"]) == 0
    text = capsys.readouterr().out
    assert "posttrain status --workdir=RUN" in text and "--workdir=" in text and "--json=" in text
    assert "--config=" not in text
