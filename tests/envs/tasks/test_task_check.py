"""`posttrain tasks check`: each planted fault in a task file is found and its rows named, a clean file from another
seed of the same generator is (almost) never flagged, and the command's exit code guards a launch."""
import json

import pytest
import reasoning_gym

from envs.tasks import task_check


def generated(name, seed, size, prefix):
    """Rows of a reasoning-gym dataset; its item i is drawn with seed + i, so sets of distinct seeds closer than their
    sizes share items (seeds here are 10,000 apart)."""
    seed *= 10_000
    return [{"id": f"{prefix}{i}", "prompt": x["question"], "answer": x["answer"]}
            for i, x in enumerate(reasoning_gym.create_dataset(name, seed=seed, size=size))]


def write(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return str(path)


def mangle(text):
    """The same prompt with case, whitespace and punctuation changed."""
    return "  " + text.upper().replace(".", " ;").replace("?", "!").replace(" ", "   ") + " "


@pytest.fixture(scope="module")
def suite_rows():
    return [(r["id"], r["prompt"]) for r in generated("family_relationships", 2, 300, "eval-")]


def findings(report, check):
    return {row for f in report.findings if f.check == check for row in f.rows}


def rows_flagged(report):
    """The rows the row checks name (the floor is the domain's: family_relationships pays ~0.15 for "son")."""
    return {row for f in report.findings if f.check != "floor" for row in f.rows}


def test_each_planted_fault_is_found_and_its_rows_named(tmp_path, suite_rows):
    rows = generated("family_relationships", 1, 200, "t")
    copied = [{"id": f"copied{i}", "prompt": mangle(suite_rows[i * 7][1]), "answer": "x"} for i in range(5)]
    words = rows[10]["prompt"].split(" ")
    words[3] = "Zebulon" if words[3] != "Zebulon" else "Quincy"
    near = {"id": "near", "prompt": " ".join(words), "answer": rows[10]["answer"]}
    duplicate = {"id": "dup", "prompt": rows[20]["prompt"], "answer": rows[20]["answer"]}
    wrong = [{"id": "wrong-number", "prompt": "How many legs has a spider?", "answer": "eight",
              "verifier": "numeric"},
             {"id": "wrong-choice", "prompt": "Pick one", "answer": "E", "choices": ["a", "b", "c", "d"],
              "verifier": "choice"}]
    path = write(tmp_path / "train.jsonl", rows + copied + [near, duplicate] + wrong,
                 extra_lines=['{"prompt": "no closing brace"', '{"answer": "no prompt"}'])
    report, _ = task_check.check_file(path, reference={"suite/family": suite_rows}, probe_tasks=50)
    assert not report.ok
    schema = findings(report, "schema") | findings(report, "golden")
    assert {f"{path}:210", f"{path}:211"} <= schema  # the malformed lines, by file and line
    assert any("wrong-number" in r or f"{path}:208" == r for r in schema)
    assert any("wrong-choice" in r or f"{path}:209" == r for r in schema)
    assert {f"copied{i}" for i in range(5)} <= findings(report, "contamination")
    assert {"near", "t10"} <= findings(report, "near_duplicate")
    assert {"dup", "t20"} <= findings(report, "duplicate")
    planted = {f"copied{i}" for i in range(5)} | {"near", "t10", "dup", "t20", "wrong-number", "wrong-choice"}
    others = rows_flagged(report) - planted - {f"{path}:{n}" for n in range(200, 213)}
    assert len(others) <= 2, others  # <= 1% of the 200 clean rows
    text = task_check.format_report([report])
    assert "FAIL" in text and "copied0" in text and "contamination" in text


def test_a_domain_a_constant_reply_games_fails_the_floor_check_naming_the_rows(tmp_path):
    path = write(tmp_path / "syllogism.jsonl", generated("syllogism", 1, 120, "s"))
    report, _ = task_check.check_file(path, probe_tasks=60)
    gamed = [f for f in report.findings if f.check == "floor"]
    assert gamed and report.floor >= 0.2 and "constant" in report.probe
    assert len(gamed[0].rows) >= 20 and all(r.startswith("s") for r in gamed[0].rows)


def test_a_file_from_another_seed_of_the_generator_is_not_flagged(tmp_path, suite_rows):
    path = write(tmp_path / "clean.jsonl", generated("family_relationships", 3, 300, "c"))
    report, _ = task_check.check_file(path, reference={"suite/family": suite_rows}, probe_tasks=50)
    assert len(rows_flagged(report)) <= 3, [f.message for f in report.findings]  # <= 1% of 300 rows


def test_files_are_checked_against_each_other(tmp_path):
    a = generated("family_relationships", 4, 50, "a")
    b = generated("family_relationships", 5, 50, "b") + [dict(a[0], id="from-a")]
    reports = task_check.check_files([write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b)], probe_tasks=20)
    assert reports[0].ok and "from-a" in findings(reports[1], "contamination")
    out = task_check.to_json(reports)
    assert out["ok"] is False and out["files"][1]["flagged_rows"] >= 1


@pytest.mark.parametrize("content", ["", "\n\n", "prompt,answer\n"])
def test_an_empty_file_fails_the_check(tmp_path, content):
    path = tmp_path / ("e.csv" if "," in content else "e.jsonl")
    path.write_text(content)
    report, _ = task_check.check_file(str(path))
    assert not report.ok and "no rows" in report.findings[0].message


def test_every_malformed_row_is_its_own_finding_and_an_unreadable_file_stops_nothing(tmp_path):
    bad = write(tmp_path / "bad.jsonl", [], extra_lines=[f'{{"answer": "{i}"}}' for i in range(16)])
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,answer\ncaf\xe9,1\n")
    good = write(tmp_path / "good.jsonl", generated("family_relationships", 6, 30, "g"))
    reports = task_check.check_files([bad, str(latin), good], probe_tasks=10)
    assert len(reports[0].findings) == 16 and all("no prompt" in f.message for f in reports[0].findings)
    assert reports[1].findings[0].message.startswith(f"{latin}:2: not UTF-8")
    assert reports[2].ok  # checked although the file before it could not be read
    assert len(task_check.to_json(reports)["files"][0]["findings"]) == 16


def test_the_floor_covers_every_row_whatever_its_split(tmp_path):
    """Four of seven rows answer 42 and only two rows are in the test split: the constant still fails the check."""
    rows = [{"id": f"n{i}", "prompt": f"Question {i}?", "answer": a, "split": "test" if i < 2 else "train"}
            for i, a in enumerate(["42", "42", "7", "42", "9", "42", "13"])]
    report, _ = task_check.check_file(write(tmp_path / "n.jsonl", rows), verifier="numeric")
    assert report.floor >= 0.5 and any(f.check == "floor" for f in report.findings)
