"""`posttrain tasks check|export` on the command line: the verbs, exit codes 0 / 1 / 2 and one-line errors."""
import json
import pathlib

import pytest
from absl.testing import flagsaver

from posttrain import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main(*args):
    with flagsaver.flagsaver():
        return cli.main(["posttrain", *args])


def write(path, rows, extra=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return str(path)


ROWS = [{"id": f"r{i}", "prompt": f"What is {i} times {i + 3}, as a number of apples in {i} boxes?",
         "answer": str(i * (i + 3))} for i in range(30)]


def test_a_clean_file_passes_and_a_faulty_one_exits_1_with_a_table(tmp_path, capsys):
    assert main("tasks", "check", write(tmp_path / "ok.jsonl", ROWS), "--verifier=numeric") == 0
    assert "PASS" in capsys.readouterr().out
    bad = write(tmp_path / "bad.jsonl", ROWS + [dict(ROWS[3], id="again")], extra="{oops\n")
    assert main("tasks", "check", bad, "--verifier=numeric") == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "bad.jsonl:32" in out and "again" in out


@pytest.mark.parametrize("args,message", [
    (("tasks",), "needs a verb"),
    (("tasks", "chek", "x.jsonl"), "'chek' is none of them (did you mean 'check'?)"),
    (("tasks", "check"), "needs at least one task file"),
    (("tasks", "check", "{tmp}/nope.jsonl"), "no such file"),
    (("tasks", "check", "{tmp}/ok.jsonl", "--verifier=nonsense"), "nonsense"),
    (("tasks", "check", "{tmp}/ok.jsonl", "--fields=prompt"), "--fields=prompt: expected"),
    (("tasks", "export", "--out={tmp}/x.jsonl"), "needs --from_archive=RUN and --out"),
    (("tasks", "export", "--from_archive={tmp}", "--out={tmp}/x.csv"), "the export is JSONL"),
    (("tasks", "export", "--from_archive={tmp}/none", "--out={tmp}/x.jsonl"), "no such directory"),
    (("train", "configs/tiny.py"), "takes flags only"),
    (("train", f"--config={ROOT}/configs/task_file.py"), "get_config() raised ValueError: configs/task_file.py needs "
     "the task file after a colon"),  # a config file's own error: its last line, not ml_collections' traceback
])
def test_mistakes_are_one_line_with_exit_code_2(tmp_path, capsys, args, message):
    write(tmp_path / "ok.jsonl", ROWS)
    assert main(*[a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and message in err[-1], err


def test_export_refuses_an_unknown_status_listing_the_statuses(tmp_path, capsys):
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "step_00000000.parquet").write_bytes(b"")
    assert main("tasks", "export", f"--from_archive={tmp_path}", f"--out={tmp_path}/x.jsonl", "--status=bogus") == 2
    assert "['bogus'] are no episode statuses; statuses: ok, wrong" in capsys.readouterr().err
