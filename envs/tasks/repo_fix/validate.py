"""Which mutations are defects: the canonical solution and its mutants run against a problem's tests in one
sandbox run (`sandboxed` ``validate`` mode), lazily, one problem at a time, cached per process.

A mutant is a *defect* when it fails a visible and a hidden case and runs no case into the time limit (a hanging
mutant would slow every test run of the episode); time is counted in executed lines, so tasks are the same on
any machine. Candidates: docs/repo_fix.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
import threading

from envs import sandbox
from envs.tasks.repo_fix import mutate, problems as problems_lib, sandboxed, scoring

MAX_SINGLES = 24
PAIR_POOL = 12
MAX_PAIRS = 8
CASE_S = 10.0  # per-case wall limit while validating (seconds; only code stuck in C meets it, see `sandboxed`)
MAX_TEXT_S = 30.0  # all the cases of one module text
BUDGET_S = 60.0  # no text starts after this (the rest count as not defects)
LIMITS = sandbox.Limits(cpu_s=120.0, wall_s=BUDGET_S + MAX_TEXT_S + 15.0, memory_mb=1536, max_procs=8,
                        max_output_bytes=1 << 20)


@dataclasses.dataclass(frozen=True)
class Validated:
    """A problem's validation: its visible/hidden split, the defects kept (seeded order), and how many ran."""

    problem: problems_lib.Problem
    visible: tuple[problems_lib.Case, ...]
    hidden: tuple[problems_lib.Case, ...]
    singles: tuple[mutate.Mutation, ...]
    doubles: tuple[tuple[mutate.Mutation, mutate.Mutation], ...]
    tried: int
    reason: str = ""  # why the problem has no defects at all, when it has none

    @property
    def variants(self) -> list[tuple[mutate.Mutation, ...]]:
        """Every kept defect set: singles first, then pairs."""
        return [(m,) for m in self.singles] + list(self.doubles)


def candidate_order(mutations: list[mutate.Mutation], seed: int, task_id: str) -> list[mutate.Mutation]:
    """`mutations` interleaved over operator families (family order and each family shuffled with the seed)."""
    rng = random.Random(f"repo_fix-mutants:{seed}:{task_id}")
    families = {}
    for m in mutations:
        families.setdefault(m.op, []).append(m)
    ops = sorted(families)
    rng.shuffle(ops)
    for op in ops:
        rng.shuffle(families[op])
    interleaved = itertools.zip_longest(*(families[op] for op in ops))
    return [m for round_ in interleaved for m in round_ if m is not None]


def _pairs(pool: list[mutate.Mutation], seed: int, task_id: str) -> list[tuple[mutate.Mutation, mutate.Mutation]]:
    pairs = [(a, b) for a, b in itertools.combinations(pool, 2) if not a.overlaps(b)]
    random.Random(f"repo_fix-pairs:{seed}:{task_id}").shuffle(pairs)
    return [tuple(sorted(p, key=lambda m: m.start)) for p in pairs[:MAX_PAIRS]]


def _is_defect(outcome: dict) -> bool:
    if "error" in outcome or outcome.get("stopped"):
        return False
    runs = outcome["visible"] + outcome["hidden"]
    return "timeout" not in runs and "fail" in outcome["visible"] and "fail" in outcome["hidden"]


def run_validation(problem: problems_lib.Problem, visible, hidden, texts: list[str],
                   isolation: str = "strict") -> list[dict]:
    """Per text, {"visible", "hidden"} lists of "pass" | "fail" | "timeout", or {"error"}; RuntimeError on failure."""
    payload = {"module": "toolbox.core", "entry": problem.entry, "prelude": problem.prelude,
               "visible": [c.source for c in visible], "hidden": [c.source for c in hidden], "texts": texts,
               "case_s": CASE_S, "text_s": min(CASE_S * (len(visible) + len(hidden)) + 2.0, MAX_TEXT_S),
               "budget_s": BUDGET_S}
    result = scoring.run_program("validate", payload, {}, LIMITS, isolation)
    lines = [line for line in result.stdout.splitlines() if line.startswith(sandboxed.VALIDATED)]
    if result.status != "ok" or not lines:
        raise RuntimeError(f"RepoFix: validating {problem.task_id} failed ({result.status}: {result.reason}; "
                           f"stderr {result.stderr[-300:]!r})")
    return json.loads(lines[-1][len(sandboxed.VALIDATED):])


def validate(problem: problems_lib.Problem, seed: int, isolation: str = "strict") -> Validated:
    """The `Validated` record of `problem` for `seed`; a problem whose canonical solution fails keeps no defect.

    Raises ValueError when the problem is not usable, RuntimeError when the sandbox fails."""
    visible, hidden = problems_lib.split_cases(problem, seed)
    order = candidate_order(mutate.enumerate_mutations(problem.module, problem.functions), seed, problem.task_id)
    singles = order[:MAX_SINGLES]
    pairs = _pairs(singles[:PAIR_POOL], seed, problem.task_id)
    texts = [problem.module] + [mutate.apply(problem.module, [m]) for m in singles] + \
            [mutate.apply(problem.module, list(p)) for p in pairs]
    outcomes = run_validation(problem, visible, hidden, texts, isolation)
    canonical = outcomes[0]
    tried = len(texts) - 1
    if "error" in canonical or set(canonical.get("visible", []) + canonical.get("hidden", ["-"])) != {"pass"}:
        return Validated(problem, visible, hidden, (), (), tried, reason=f"canonical solution fails: {canonical}")
    kept = [m for m, o in zip(singles, outcomes[1:]) if _is_defect(o)]
    kept_pairs = [p for p, o in zip(pairs, outcomes[1 + len(singles):]) if _is_defect(o)]
    reason = "" if kept or kept_pairs else f"none of {tried} mutants fails a visible and a hidden case"
    return Validated(problem, visible, hidden, tuple(kept), tuple(kept_pairs), tried, reason)


_CACHE: dict[tuple, Validated] = {}
_LOCK = threading.Lock()


def cached(problem: problems_lib.Problem, seed: int, isolation: str = "strict") -> Validated:
    """`validate`, memoised per (problem, seed, isolation) for the life of the process."""
    key = (problem.task_id, problem.module, seed, isolation)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    record = validate(problem, seed, isolation)
    with _LOCK:
        return _CACHE.setdefault(key, record)
