"""Tests for RepoFix-v0's task generation: envs/tasks/repo_fix/problems.py (visible/hidden split), mutate.py
(defect operators), sandboxed.py (the value codec), validate.py and tasks.py (the task source)."""
import ast

import pytest

from envs.tasks.repo_fix import mutate, problems, sandboxed, tasks, validate

MODULE = '''"""m."""
def f(xs, n):
    """Docstring: 1 < 2 stays."""
    total = 0
    for i in range(1, n):
        if xs[i] > 0:
            total += xs[i] * 2
        else:
            total -= 1
    if n == 0:
        return -1
    return max(total, n) - xs[-1] + len(xs[1:n])
'''


@pytest.fixture(scope="module")
def he():
    return problems.load()


def _mutants(op):
    return [(m, mutate.apply(MODULE, [m])) for m in mutate.enumerate_mutations(MODULE, ["f"]) if m.op == op]


@pytest.mark.parametrize("op,old,new", [
    ("compare", "if xs[i] > 0:", "if xs[i] >= 0:"),
    ("compare", "if n == 0:", "if n != 0:"),
    ("arithmetic", "total += xs[i] * 2", "total -= xs[i] * 2"),
    ("arithmetic", "total += xs[i] * 2", "total += xs[i] + 2"),
    ("off_by_one", "range(1, n)", "range(1, n + 1)"),
    ("off_by_one", "range(1, n)", "range(2, n)"),
    ("off_by_one", "len(xs[1:n])", "len(xs[1:n - 1])"),
    ("off_by_one", "- xs[-1]", "- xs[-2]"),
    ("constant", "total = 0", "total = 1"),
    ("constant", "return -1", "return -2"),
    ("drop_branch", "        else:\n            total -= 1\n", ""),
    ("drop_branch", "    if n == 0:\n        return -1\n", ""),
    ("swap_args", "max(total, n)", "max(n, total)"),
    ("swap_args", "range(1, n)", "range(n, 1)"),
    ("wrong_variable", "len(xs[1:n])", "len(total[1:n])"),
])
def test_each_operator_family_makes_the_expected_one_spot_edit(op, old, new):
    texts = [text for _, text in _mutants(op)]
    assert MODULE.replace(old, new, 1) in texts


def test_every_mutation_parses_changes_the_code_and_spares_the_docstring():
    mutations = mutate.enumerate_mutations(MODULE, ["f"])
    assert {m.op for m in mutations} == set(mutate.OPERATORS)
    texts = [mutate.apply(MODULE, [m]) for m in mutations]
    assert len(set(texts)) == len(texts) and MODULE not in texts
    for text in texts:
        ast.parse(text)
        assert '"""Docstring: 1 < 2 stays."""' in text
    a, b = next((a, b) for a in mutations for b in mutations if a != b and a.overlaps(b))
    with pytest.raises(ValueError, match="overlap"):
        mutate.apply(MODULE, [a, b])
    with pytest.raises(ValueError, match="no top-level function"):
        mutate.enumerate_mutations(MODULE, ["g"])


def test_no_mutation_sites_is_exactly_the_problems_without_any(he):
    sample = [p for p in he if p.number in tasks.NO_MUTATION_SITES or p.number % 16 == 0]
    for p in sample:
        none = not mutate.enumerate_mutations(p.module, p.functions)
        assert none == (p.number in tasks.NO_MUTATION_SITES), p.task_id


def test_hidden_and_visible_inputs_are_disjoint_and_the_split_is_seeded(he):
    usable = [p for p in he if p.usable]
    assert len(usable) == 160 and {p.number for p in he if not p.usable} == {32, 34, 38, 50}
    for p in usable:
        visible, hidden = problems.split_cases(p, seed=0)
        assert visible and hidden and len(visible) + len(hidden) == len(p.cases)
        assert not {k for c in visible for k in c.inputs} & {k for c in hidden for k in c.inputs}, p.task_id
        assert problems.split_cases(p, seed=0) == (visible, hidden)
    assert any(problems.split_cases(p, 0) != problems.split_cases(p, 1) for p in usable)
    with pytest.raises(ValueError, match="input group"):
        problems.split_cases(he[34], seed=0)


def test_cases_and_visible_test_file_come_from_humaneval_asserts(he):
    p = he[151]  # has setup lines (lst = ..., odd_sum = ...) between its asserts
    assert any(s.startswith("lst = ") for s in p.setup) and all("candidate" in c.source for c in p.cases)
    assert not any("This prints" in c.source for c in p.cases)
    visible, _ = problems.split_cases(p, seed=0)
    text = problems.visible_test_file(p, visible, "toolbox", "core")
    namespace = {}
    exec(compile(p.module, "m", "exec"), namespace)  # trusted: the canonical solution
    fn = namespace[p.entry]
    test_ns = {}
    exec(compile(text.replace("from toolbox.core import double_the_difference", ""), "t", "exec"),
         {**test_ns, p.entry: fn, "__name__": "t"})
    assert text.count("def test_") == len(visible) and "candidate" not in text


@pytest.mark.parametrize("value", [None, True, 3, -2 ** 70, 1.5, float("inf"), 2j, "é\udcff", b"\x00",
                                   [1, (2, 3), {4}, frozenset({5})], {"a": [1], 2: None}, ((),)])
def test_codec_round_trips_builtin_values_exactly(value):
    import json

    back = sandboxed.decode(json.loads(json.dumps(sandboxed.encode(value))))
    assert back == value and type(back) is type(value)


class _AlwaysEqual:
    def __eq__(self, other):
        return True


class _MyInt(int):
    pass


@pytest.mark.parametrize("value", [_AlwaysEqual(), _MyInt(3), [1, _AlwaysEqual()], {"k": _MyInt(1)}, map(str, [])])
def test_codec_refuses_anything_but_exact_builtins(value):
    with pytest.raises(TypeError, match="unsupported type"):
        sandboxed.encode(value)


def test_codec_refuses_deep_nesting():
    deep = []
    for _ in range(sandboxed.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match="too deep"):
        sandboxed.encode(deep)


def test_splits_are_disjoint_by_problem_with_enough_tasks():
    train, test = tasks.RepoFixTasks("train"), tasks.RepoFixTasks("test")
    assert not {p.task_id for p in train.problems} & {p.task_id for p in test.problems}
    assert train.num_tasks >= 300 and test.num_tasks >= 100
    assert len(train.problems) + len(test.problems) == 160 - len(tasks.NO_MUTATION_SITES)
    with pytest.raises(ValueError, match="split"):
        tasks.RepoFixTasks("validation")
    with pytest.raises(IndexError):
        train.get_task(train.num_tasks)


def test_validation_keeps_only_defects_the_tests_catch(he):
    v = validate.cached(he[0], seed=0)
    assert v.singles and v.doubles and v.tried == validate.MAX_SINGLES + validate.MAX_PAIRS
    visible, hidden = problems.split_cases(he[0], seed=0)
    outcomes = validate.run_validation(he[0], visible, hidden, [mutate.apply(he[0].module, list(d))
                                                                for d in v.variants[:3]])
    for outcome in outcomes:
        assert "fail" in outcome["visible"] and "fail" in outcome["hidden"]


def test_tasks_are_deterministic_and_carry_their_defects():
    source = tasks.RepoFixTasks("train")
    task = source.get_task(2)  # problem 0's "double" slot
    assert task == tasks.RepoFixTasks("train").get_task(2)
    assert (task["slot"], task["difficulty"], task["files_with_defects"]) == ("double", 2, 1)
    assert task["files"] != task["original_files"] and task["golden_patch"].count("\n-") >= 1
    pair = source.get_task(3)
    assert pair["slot"] == "two_files" and pair["files_with_defects"] == 2 and len(pair["problems"]) == 2
    assert {"toolbox/core.py", "toolbox/extras.py", "tests/test_extras.py"} <= set(pair["files"])
    other_seed = tasks.RepoFixTasks("train", seed=1).get_task(0)
    assert other_seed["files"] != source.get_task(0)["files"]


def test_a_task_is_the_same_in_another_process_with_another_hash_seed():
    import hashlib
    import json
    import os
    import subprocess
    import sys

    code = ("import hashlib, json; from envs.tasks.repo_fix import tasks; "
            "print(hashlib.sha256(json.dumps(tasks.RepoFixTasks('train').get_task(2), sort_keys=True).encode())"
            ".hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    here = json.dumps(tasks.RepoFixTasks("train").get_task(2), sort_keys=True).encode()
    assert out == hashlib.sha256(here).hexdigest()
