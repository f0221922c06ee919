"""Named verifiers (`envs.verify.named`): a timed table of accepted and refused replies per verifier, spec parsing,
row checks, reference replies and weighted combination. scripts/verifier_table.py prints the tables as Markdown."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, NamedTuple

import pytest

from envs import sandbox
from envs.verify import named, row_verifiers

BOUND_S = 2.0  # most seconds one table row may take (code_tests: its timeout_s + 5)
MB_NINES, MB_A, MB_ARABIC = "9" * 1_000_000, "a" * 1_000_000, "\u0664" * 1_000_000
JUNK = os.urandom(4096).decode("latin-1") + "\ud800\x00\uffff"  # binary bytes, a lone surrogate, NUL


class Case(NamedTuple):
    """One table row: `spec` scores `reply` against `row` to `expected`; `note` says what the row shows."""

    spec: Any
    reply: Any
    row: dict
    expected: float
    note: str = ""


def sandbox_runner(program: str, seconds: float) -> sandbox.SandboxResult:
    """code_tests' runner: one fresh bubblewrap sandbox with cpu_s = wall_s = seconds."""
    return sandbox.run(program, limits=sandbox.Limits(cpu_s=seconds, wall_s=seconds))


CAPITAL = {"answer": "Paris", "prompt": "Is the capital of France Paris or Lyon?\nAnswer with one word."}
TIMES = {"answer": 42, "prompt": "What is 6 times 7?"}
GSM = {"answer": "She sold 48 / 2 = 24 in May.\n48 + 24 = 72\n#### 72",
       "prompt": "Natalia sold clips to 48 friends in April and half as many in May. How many in all?"}
CODE = r"[A-Z]{3}-\d{4}"
MCQ = {"answer": "B", "choices": ["3", "4", "5", "6"], "prompt": "What is 2 + 2?\nA) 3\nB) 4\nC) 5\nD) 6\nAnswer:"}
PERSON = {"answer": {"name": "Ada", "age": 36}, "prompt": 'Reply with {"name": ..., "age": ...} for Ada Lovelace.'}
ID_SCHEMA = {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}}
ADD = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0", "entry_point": "add",
       "solution": "def add(a, b):\n    return a + b", "prompt": "Write add(a, b)."}

TABLES: dict[str, list[Case]] = {
    "exact": [
        Case("exact", "<answer>Paris</answer>", CAPITAL, 1.0, "answer tag"),
        Case("exact", "It is the capital.\nparis", CAPITAL, 1.0, "last line, case-insensitive"),
        Case("exact", "#### \\boxed{x}\n#### Paris", CAPITAL, 1.0, "after the last ####"),
        Case("exact", "\\boxed{\uff30\uff41\uff52\uff49\uff53}", CAPITAL, 1.0, "full-width letters (NFKC)"),
        Case("exact", "Paris.", CAPITAL, 0.0, "punctuation kept by default"),
        Case({"name": "exact", "strip_punctuation": True}, "\u00abParis.\u00bb", CAPITAL, 1.0, "strip_punctuation"),
        Case({"name": "exact", "case_sensitive": True}, "paris", CAPITAL, 0.0, "case_sensitive"),
        Case({"name": "exact", "extract": "hash"}, "<answer>Paris</answer>", CAPITAL, 0.0, "extract=hash, no ####"),
        Case("exact", "<answer>new  york\ncity</answer>", {"answer": ["NYC", "New York City"]}, 1.0,
             "one of a list; whitespace collapsed"),
        Case("exact", CAPITAL["prompt"], CAPITAL, 0.0, "the prompt"),
        Case("exact", "Paris, Lyon", CAPITAL, 0.0, "a list of candidates"),
        Case("exact", "The capital is:\n**Paris**", CAPITAL, 1.0, "markdown bold around the answer"),
        Case("exact", "<answer>`Paris`</answer>", CAPITAL, 1.0, "code ticks around the answer"),
        Case("exact", "**Paris** or **Lyon**", CAPITAL, 0.0, "two bold candidates"),
        Case("exact", "<answer>Paris or Lyon</answer>", CAPITAL, 0.0, "two answers in the tag"),
        Case("exact", "<think>Paris</think>Lyon", CAPITAL, 0.0, "the reasoning trace is not the answer"),
        Case("exact", "", CAPITAL, 0.0, "empty"),
        Case("exact", None, CAPITAL, 0.0, "None"),
        Case("exact", MB_A, CAPITAL, 0.0, "1 MB of 'a'"),
        Case("exact", JUNK, CAPITAL, 0.0, "binary junk"),
    ],
    "numeric": [
        Case("numeric", "6 * 7 = 42", TIMES, 1.0, "last number"),
        Case("numeric", "#### 42", TIMES, 1.0, "####"),
        Case("numeric", "<answer>42</answer> (not 43)", TIMES, 1.0, "the tag decides"),
        Case("numeric", "\u0664\u0662", TIMES, 1.0, "Arabic-Indic digits"),
        Case("numeric", "\uff14\uff12", TIMES, 1.0, "full-width digits"),
        Case("numeric", "<answer>42 dollars</answer>", TIMES, 1.0, "unit stripped"),
        Case({"name": "numeric", "units": False}, "<answer>42 dollars</answer>", TIMES, 0.0, "units=False"),
        Case("numeric", "The total is 1,234.", {"answer": 1234}, 1.0, "thousands separator"),
        Case("numeric", "\\boxed{45\\%}", {"answer": "45%"}, 1.0, "percent"),
        Case("numeric", "41.99", TIMES, 0.0, "off by 0.01"),
        Case({"name": "numeric", "tolerance": 0.01}, "41.99", TIMES, 1.0, "tolerance=0.01"),
        Case({"name": "numeric", "rel_tolerance": 0.01}, "1005", {"answer": 1000}, 1.0, "rel_tolerance=0.01"),
        Case("numeric", "42 or 43", TIMES, 0.0, "two candidates, refused"),
        Case("numeric", "43 or 42", TIMES, 0.0, "two candidates, the right one last: refused"),
        Case("numeric", "It is either 41 or 42.", TIMES, 0.0, "a hedge on the last line"),
        Case("numeric", "3/4", {"answer": 4}, 0.0, "a fraction ending in the answer's digits"),
        Case("numeric", "3/4", {"answer": 0.75}, 1.0, "an untagged fraction read whole"),
        Case("numeric", "4.2e2", {"answer": 2}, 0.0, "an exponent ending in the answer's digits"),
        Case("numeric", "1e-3", {"answer": -3}, 0.0, "a negative exponent is no negative answer"),
        Case("numeric", "It is 4.2e1", TIMES, 1.0, "an untagged exponent read whole"),
        Case("numeric", "x=42", TIMES, 1.0, "the value after '='"),
        Case("numeric", "<answer>about 42</answer>", TIMES, 0.0, "tag holding more than a number"),
        Case("numeric", TIMES["prompt"], TIMES, 0.0, "the prompt"),
        Case("numeric", "", TIMES, 0.0, "empty"),
        Case("numeric", 42, TIMES, 0.0, "an int, not a str"),
        Case("numeric", MB_NINES, TIMES, 0.0, "1 MB of '9'"),
        Case("numeric", MB_ARABIC, TIMES, 0.0, "1 MB of Arabic-Indic digits"),
        Case("numeric", JUNK, TIMES, 0.0, "binary junk"),
    ],
    "math": [
        Case("math", "24 + 48 = 72\n#### 72", GSM, 1.0, "#### against a GSM8K solution"),
        Case("math", "\\boxed{72}", GSM, 1.0, "boxed"),
        Case("math", "\u0667\u0662", GSM, 1.0, "Arabic-Indic digits"),
        Case("math", "so \\boxed{\\frac{1}{2}}", {"answer": "0.5"}, 1.0, "fraction = decimal"),
        Case({"name": "math", "methods": ["boxed"]}, "#### 72", GSM, 0.0, "methods=[boxed]"),
        Case("math", GSM["prompt"], GSM, 0.0, "the prompt"),
        Case("math", "", GSM, 0.0, "empty"),
        Case("math", MB_NINES, GSM, 0.0, "1 MB of '9'"),
    ],
    "regex": [
        Case({"name": "regex", "pattern": CODE}, "<answer>ABC-1234</answer>", {}, 1.0, "fullmatch of the tag"),
        Case({"name": "regex", "pattern": CODE}, "The code is\nABC-\uff11\uff12\uff13\uff14", {}, 1.0,
             "last line, full-width digits"),
        Case({"name": "regex", "pattern": CODE}, "The code is ABC-1234", {}, 0.0, "fullmatch of the last line"),
        Case({"name": "regex", "pattern": CODE, "mode": "search"}, "The code is ABC-1234.", {}, 1.0, "search"),
        Case({"name": "regex", "pattern": "abc-\\d{4}", "flags": "i"}, "ABC-1234", {}, 1.0, "flags=i"),
        Case("regex", "x = 42", {"pattern": r"x = \d+"}, 1.0, "pattern from the row"),
        Case({"name": "regex", "pattern": "(a+)+b", "mode": "search"}, MB_A, {}, 0.0,
             "catastrophic pattern on 1 MB: timeout"),
        Case({"name": "regex", "pattern": CODE}, MB_NINES, {}, 0.0, "1 MB of '9'"),
        Case({"name": "regex", "pattern": CODE}, "", {}, 0.0, "empty"),
        Case({"name": "regex", "pattern": CODE}, None, {}, 0.0, "None"),
    ],
    "choice": [
        Case("choice", "<answer>B</answer>", MCQ, 1.0, "answer tag"),
        Case("choice", "The answer is (B).", MCQ, 1.0, "phrase"),
        Case("choice", "Answer: b", MCQ, 1.0, "phrase, lowercase"),
        Case("choice", "The answer is a bit tricky.\nB", MCQ, 1.0, "'a' as an article; a bare last line"),
        Case("choice", "<answer>B) 4</answer>", MCQ, 1.0, "letter and option text"),
        Case("choice", "\uff22", MCQ, 1.0, "full-width letter"),
        Case("choice", "<answer>B</answer>", {"answer": 1, "choices": ["3", "4"]}, 1.0, "index answer"),
        Case("choice", "The answer is B", {"answer": "4", "choices": ["3", "4", "5"]}, 1.0, "answer as choice text"),
        Case({"name": "choice", "choices": "ABCDE"}, "E", {"answer": "E"}, 1.0, "choices=ABCDE"),
        Case("choice", "The answer is C.", MCQ, 0.0, "wrong letter"),
        Case("choice", "The answer is A or B.", MCQ, 0.0, "two letters"),
        Case("choice", "A, B, C, D", MCQ, 0.0, "every choice"),
        Case("choice", "<answer>A, B, C, D</answer>", MCQ, 0.0, "every choice in the tag"),
        Case("choice", "A) 3\nB) 4\nC) 5\nD) 6", MCQ, 0.0, "the choices listed"),
        Case("choice", MCQ["prompt"], MCQ, 0.0, "the prompt"),
        Case("choice", "The answer is E.", MCQ, 0.0, "not among the choices"),
        Case("choice", "", MCQ, 0.0, "empty"),
        Case("choice", b"B", MCQ, 0.0, "bytes, not a str"),
        Case("choice", MB_A, MCQ, 0.0, "1 MB of 'a'"),
        Case("choice", "The answer is " * 70_000 + "B", MCQ, 1.0, "1 MB of phrases, the last read"),
    ],
    "json": [
        Case("json", '```json\n{"name": "Ada", "age": 36}\n```', PERSON, 1.0, "json fence"),
        Case("json", 'Set {x} first. {"name": "Ada", "age": 36, "born": 1815}', PERSON, 1.0,
             "last balanced object, extra keys"),
        Case("json", '{"name": "Ada", "age": 37}', PERSON, 0.0, "a field differs"),
        Case({"name": "json", "numeric_tolerance": 1}, '{"name": "Ada", "age": 37}', PERSON, 1.0,
             "numeric_tolerance=1"),
        Case({"name": "json", "fields": ["name"]}, '{"name": "Ada", "age": 99}', PERSON, 1.0, "fields=[name]"),
        Case("json", '{"name": "Ada", "age": "36"}', PERSON, 0.0, "a string, not a number"),
        Case("json", '{"name": "Ada", "age": 36} then {"name": "Bob", "age": 1}', PERSON, 0.0, "the last value"),
        Case("json", '```json\n{"name": "Ada", age: 36}\n```', PERSON, 0.0, "invalid JSON in the fence"),
        Case({"name": "json", "schema": ID_SCHEMA}, 'Done: {"id": 3}', {}, 1.0, "schema only"),
        Case({"name": "json", "schema": ID_SCHEMA}, '{"id": "3"}', {}, 0.0, "schema refuses"),
        Case("json", PERSON["prompt"], PERSON, 0.0, "the prompt"),
        Case("json", " " * 1_000_000 + '{"name": "Ada", "age": 36}', PERSON, 1.0, "1 MB, object at the end"),
        Case("json", '{"name": "Ada", "age": 36}' + "x" * 1_000_000, PERSON, 0.0, "object before the scanned tail"),
        Case("json", "{" * 1_000_000, PERSON, 0.0, "1 MB of '{'"),
        Case("json", "[" * 50_000 + "]" * 50_000, PERSON, 0.0, "nested 50,000 deep"),
        Case("json", "", PERSON, 0.0, "empty"),
        Case("json", None, PERSON, 0.0, "None"),
    ],
    "code_tests": [
        Case("code_tests", f"```python\n{ADD['solution']}\n```", ADD, 1.0, "passes (sandbox run)"),
        Case("code_tests", "```python\ndef add(a, b):\n    return a - b\n```", ADD, 0.0, "assert fails (sandbox run)"),
        Case("code_tests", "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```", ADD, 0.0,
             "exits 0 before the tests (sandbox run)"),
        Case("code_tests", "```python\ndef plus(a, b):\n    return a + b\n```", ADD, 0.0, "no entry point"),
        Case("code_tests", ADD["solution"], ADD, 0.0, "no ```python block"),
        Case("code_tests", ADD["prompt"], ADD, 0.0, "the prompt"),
        Case("code_tests", "", ADD, 0.0, "empty"),
        Case("code_tests", None, ADD, 0.0, "None"),
        Case("code_tests", MB_A, ADD, 0.0, "1 MB of 'a'"),
    ],
}
CASES = [(name, i, case) for name, table in TABLES.items() for i, case in enumerate(table)]


def run_case(case: Case) -> tuple[named.Scored, float]:
    """(score of the case, seconds it took)."""
    t0 = time.perf_counter()
    scored = named.score(case.spec, case.reply, case.row, code_runner=sandbox_runner)
    return scored, time.perf_counter() - t0


@pytest.mark.parametrize("name,i,case", CASES, ids=[f"{name}-{i}" for name, i, _ in CASES])
def test_table_row_scores_as_expected_within_the_bound(name, i, case, record_property):
    scored, seconds = run_case(case)
    record_property("ms", round(seconds * 1000, 1))
    verdict = scored.verdict
    assert verdict.reward == case.expected, (case.note, verdict)
    assert (verdict.status == "ok") == (case.expected == 1.0), verdict
    assert verdict.reason or case.expected == 1.0  # a refusal always says why
    bound = named.parse_verifier(case.spec)[0].args.get("timeout_s", 0) + 5 if name == "code_tests" else BOUND_S
    assert seconds < bound, f"{name} row {i} ({case.note}) took {seconds:.2f} s"


def test_statuses_of_a_timeout_and_a_missing_sandbox(monkeypatch):
    spec = {"name": "regex", "pattern": "(a+)+b", "mode": "search"}
    assert named.score(spec, MB_A, {}, timeout_s=0.2).verdict.status == "timeout"  # the regex runs min(0.2, 1) s
    reply = f"```python\n{ADD['solution']}\n```"
    assert named.score("code_tests", reply, ADD).verdict.status == "infra_error"  # no runner given
    monkeypatch.setenv("POSTTRAIN_BWRAP", "")  # pretend bubblewrap is not installed: sandbox.run raises
    verdict = named.score("code_tests", reply, ADD, code_runner=sandbox_runner).verdict
    assert (verdict.reward, verdict.status) == (0.0, "infra_error") and "bubblewrap" in verdict.reason


@pytest.mark.parametrize("spec,match", [
    ("nope", r"unknown name 'nope'; valid names: exact, numeric"),
    ({"name": "numeric", "tol": 1}, r"'numeric': unknown argument 'tol'; valid keys: name, weight, tolerance"),
    ({"name": "numeric", "tolerance": "0.1"}, r"'numeric': tolerance='0.1' is invalid, expected a finite number"),
    ({"name": "numeric", "tolerance": -1}, r"tolerance=-1 is invalid, expected a finite number >= 0"),
    ({"name": "exact", "weight": 0}, r"'exact': weight must be a number > 0, got 0"),
    ([], r"empty list; give at least one of exact"),
    ({"name": "regex", "pattern": "("}, r"'regex': pattern='\(' is invalid, expected a regex that compiles"),
    ({"name": "json", "schema": {"type": "objectx"}}, r"'json': schema=.* expected a valid JSON schema"),
    ({"name": "math", "methods": ["guess"]}, r"'math': methods=\['guess'\] is invalid, expected a non-empty list"),
    ({"name": "choice", "choices": "AAB"}, r"'choice': choices='AAB' is invalid, expected a count 2-26"),
    ({"name": "code_tests", "timeout_s": 0}, r"'code_tests': timeout_s=0 is invalid"),
    ({"weight": 1}, r"unknown name None"),
    (42, r"a spec is a name or a mapping with 'name', got int"),
])
def test_parse_verifier_refuses_bad_specs_in_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        named.parse_verifier(spec)
    assert "\n" not in str(info.value)


def test_parse_verifier_fills_defaults_and_is_idempotent():
    specs = named.parse_verifier(["numeric", {"name": "exact", "weight": 3, "case_sensitive": True}])
    assert [s.name for s in specs] == ["numeric", "exact"] and [s.weight for s in specs] == [1.0, 3.0]
    assert dict(specs[0].args) == {"tolerance": 0.0, "rel_tolerance": 1e-9, "units": True}
    assert dict(specs[1].args) == {"case_sensitive": True, "strip_punctuation": False, "extract": "auto"}
    assert named.parse_verifier(specs) == specs
    rows = json.loads(json.dumps([dataclasses.asdict(s) for s in specs]))  # how a task stores its verifiers
    assert named.parse_verifier([named.VerifierSpec(r["name"], r["args"], r["weight"]) for r in rows]) == specs
    assert named.parse_verifier({"name": "math", "methods": ["boxed"]})[0].args["methods"] == ("boxed",)
    assert set(named.MODEL_GRADED) == {n for n, v in named.VERIFIERS.items() if v.model_graded}
    assert all(v.doc for v in named.VERIFIERS.values())


@pytest.mark.parametrize("spec,fields", [
    ("exact", ("answer",)), ("code_tests", ("tests",)), ("regex", ("pattern",)), ("reward_model", ()),
    ({"name": "regex", "pattern": "x"}, ()), ({"name": "json", "schema": ID_SCHEMA}, ()),
    (["exact", "code_tests", "numeric", "rubric"], ("answer", "tests", "rubric")),
])
def test_required_fields(spec, fields):
    assert named.required_fields(spec) == fields


@pytest.mark.parametrize("spec,row,problem", [
    ("exact", {}, "exact: row has no 'answer'"),
    ("exact", {"answer": ["Paris", 3]}, "exact: 'answer' must be a non-empty str or list of str"),
    ("numeric", {"answer": "forty"}, "numeric: 'answer' 'forty' is not a number"),
    ("math", {"answer": "#### "}, "math: gold solution has an empty #### line"),
    ("regex", {"pattern": "(ab"}, "regex: 'pattern' is not a regex that compiles"),
    ("choice", {"answer": "E", "choices": ["1", "2", "3", "4"]}, "choice: answer 'E' is not among the choices ABCD"),
    ("choice", {"answer": 7}, "choice: answer index 7 out of range"),
    ("json", {}, "json: row has no 'answer'"),
    ("json", {"answer": [1]}, "json: 'answer' must be a dict"),
    ({"name": "json", "schema": ID_SCHEMA}, {"answer": {"id": "x"}}, "json: 'answer' does not fit the schema"),
    ({"name": "json", "fields": ["id"]}, {"answer": {"name": "x"}}, "json: 'answer' has no field 'id'"),
    ("code_tests", {"tests": "assert (("}, "code_tests: 'tests' do not compile"),
    ("code_tests", {"tests": "assert 1", "entry_point": "1x"}, "code_tests: 'entry_point' must be a Python identifier"),
    ("rubric", {"rubric": [{"name": "tone"}]}, "rubric: rubric criterion 0 needs a str 'name' and 'description'"),
    (["exact", "regex"], {"answer": "x"}, "regex: row has no 'pattern'"),
    ("exact", ["answer"], "the row is a list, not a mapping"),
])
def test_check_row_names_the_problem(spec, row, problem):
    assert named.check_row(spec, row).startswith(problem)
    with pytest.raises(ValueError, match="the row does not fit its verifiers"):
        named.score(spec, "x", row)


def test_check_row_accepts_the_table_rows():
    assert all(named.check_row(case.spec, case.row) == "" for _, _, case in CASES)
    rubric = {"rubric": [{"name": "tone", "weight": 2, "description": "polite"}]}
    assert named.check_row(["rubric", "reward_model"], rubric) == ""


SAMPLE_ROWS = {"exact": CAPITAL, "numeric": {"answer": "1,234.5"}, "math": GSM, "regex": {"pattern": CODE,
               "example": "XYZ-0001"}, "choice": MCQ, "json": PERSON, "code_tests": ADD}


@pytest.mark.parametrize("name", [n for n, v in named.VERIFIERS.items() if not v.model_graded])
def test_reference_reply_scores_one(name):
    reply = named.reference_reply(name, SAMPLE_ROWS[name])
    assert reply is not None
    if name == "code_tests":  # the table's first row runs this very reply in the sandbox
        assert reply == TABLES["code_tests"][0].reply and TABLES["code_tests"][0].expected == 1.0
    else:
        assert named.score(name, reply, SAMPLE_ROWS[name]).verdict.reward == 1.0


@pytest.mark.parametrize("extract", row_verifiers.EXTRACT_MODES)
def test_reference_reply_fits_each_extraction(extract):
    spec = {"name": "exact", "extract": extract}
    assert named.score(spec, named.reference_reply(spec, CAPITAL), CAPITAL).verdict.reward == 1.0


def test_reference_reply_is_none_when_none_can_be_built():
    assert named.reference_reply("rubric", {"rubric": "polite"}) is None
    assert named.reference_reply("reward_model", {}) is None
    assert named.reference_reply({"name": "regex", "pattern": CODE}, {}) is None  # no example
    assert named.reference_reply({"name": "regex", "pattern": CODE}, {"example": "abc"}) is None  # does not match
    assert named.reference_reply(["exact", {"name": "regex", "pattern": "[A-Z][a-z]+"}], CAPITAL) == (
        "<answer>Paris</answer>")  # one reply that both accept


def test_weights_combine_over_the_computed_parts():
    specs = [{"name": "exact", "weight": 3}, {"name": "regex", "pattern": "\\d+", "weight": 1}]
    scored = named.score(specs, "7", {"answer": "seven"})
    assert scored.verdict.reward == 0.25 and dict(scored.parts) == {"exact": 0.0, "regex": 1.0}
    assert scored.verdict.status == "wrong" and scored.verdict.reason.startswith("exact: answer differs")
    assert named.score(specs, "7", {"answer": "7"}).verdict == named.score(specs, "7", {"answer": "7"}).verdict
    both = named.score(specs, "7", {"answer": "7"}).verdict
    assert (both.reward, both.status, both.reason) == (1.0, "ok", "")
    repeated = named.score([{"name": "regex", "pattern": "\\d+"}, {"name": "regex", "pattern": "[a-z]+"}], "42", {})
    assert repeated.verdict.reward == 0.5 and dict(repeated.parts) == {"regex#0": 1.0, "regex#1": 0.0}
    slow = {"name": "regex", "pattern": "(a+)+b", "mode": "search", "weight": 2}
    first_fails = named.score([slow, "exact"], MB_A, {"answer": "x"}, timeout_s=0.2).verdict
    assert (first_fails.reward, first_fails.status) == (0.0, "timeout") and "exact: " in first_fails.reason


def test_model_graded_specs_are_left_out_of_the_mean():
    row = {"answer": "Paris", "rubric": "Names the city."}
    scored = named.score([{"name": "rubric", "weight": 5}, "exact"], "<answer>Paris</answer>", row)
    assert scored.verdict.reward == 1.0 and dict(scored.parts) == {"exact": 1.0}
    assert [s.name for s in scored.model_graded] == ["rubric"] and scored.model_graded[0].weight == 5.0
    only = named.score(["rubric", "reward_model"], "anything", row)
    assert (only.verdict.reward, only.verdict.status, only.verdict.reason) == (0.0, "ok", "model-graded only")
    assert len(only.model_graded) == 2 and not only.parts
