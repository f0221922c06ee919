"""HumanEval scored outside the candidate's process: the sandbox only runs the solution on recorded arguments and
prints its return values as plain data; the problem's own `check` runs here, on those values.

Neither the tests nor the expected values enter the sandbox, so an early exit, a marker read from the
interpreter's frames or an object that compares equal to anything scores 0. The steps and why: docs/tasks.md.
"""
from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import random

from envs.verify import answers
from envs.verify import plain

MARKER = "posttrain-humaneval-outputs "
_CODEC = pathlib.Path(plain.__file__).read_text()
DRIVER = """import sys
sys.path.extend({site_dirs!r})
{codec}
_calls = [loads(c) for c in {calls!r}]
_namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile({solution!r}, "<humaneval>", "exec"), _namespace)
_solution = _namespace[{entry_point!r}]
_outputs = [dumps(_solution(*args)) for args in _calls]
sys.stdout.write("\\n" + {marker!r} + json.dumps(_outputs) + "\\n")
sys.stdout.flush()
"""


@contextlib.contextmanager
def seeded_random(seed: int = 0):
    """The `random` module seeded with `seed` inside, its state restored after (the tests draw from it)."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _check(task: dict, source: str):
    """The problem's `check`, defined after `source`: the prompt's helpers and the canonical solution, which some
    tests call by name for the expected value (HumanEval/33: ``candidate(x) == sort_third(x)``)."""
    namespace = {"__name__": "humaneval_check"}
    exec(compile(source + "\n\n" + task["test"], f"<{task['task_id']} test>", "exec"), namespace)
    return namespace["check"]


@functools.lru_cache(maxsize=None)
def _recorded(task_id: str, prompt: str, canonical: str, test: str, entry_point: str) -> tuple[str, ...]:
    task = {"task_id": task_id, "test": test}
    namespace = {"__name__": "humaneval_canonical"}
    exec(compile(prompt + canonical, f"<{task_id} canonical>", "exec"), namespace)
    solution, calls = namespace[entry_point], []

    def recorder(*args):
        calls.append(plain.dumps(args))  # before the solution could change them
        return solution(*args)

    with seeded_random():
        _check(task, prompt + canonical)(recorder)
    return tuple(calls)


def recorded_calls(task: dict) -> tuple[str, ...]:
    """The encoded argument tuples (`plain.dumps`) that `task`'s check calls its candidate with, in order.

    Raises AssertionError if the canonical solution fails its own tests."""
    return _recorded(task["task_id"], task["prompt"], task["canonical_solution"], task["test"], task["entry_point"])


def program(task: dict, solution: str, site_dirs: tuple = ()) -> str:
    """The sandbox program: `solution` (Python source defining task's entry point) on every recorded call."""
    return DRIVER.format(site_dirs=list(site_dirs), codec=_CODEC, calls=list(recorded_calls(task)),
                         solution=solution, entry_point=task["entry_point"], marker=MARKER)


def outputs(stdout: str) -> list | None:
    """The decoded return values of the last `MARKER` line of `stdout` (None without a well-formed one)."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        return None
    try:
        encoded = json.loads(lines[-1][len(MARKER):])
        return [plain.loads(x) for x in encoded] if type(encoded) is list and all(
            type(x) is str for x in encoded) else None
    except (ValueError, RecursionError):  # malformed, or nested past the stack
        return None


def replay(task: dict, values: list) -> str:
    """"" when `check` accepts `values` as the answers to the recorded calls (docs/tasks.md, step 3), else why not."""
    calls, made = recorded_calls(task), [0]
    if len(values) != len(calls):
        return f"{len(values)} return values for {len(calls)} calls"

    def candidate(*args):
        i = made[0]
        if i >= len(calls) or plain.dumps(args) != calls[i]:
            raise AssertionError(f"call {i} of the tests differs from the recorded one (it depends on a wrong answer)")
        made[0] += 1
        return values[i]

    try:
        with seeded_random():
            _check(task, task["prompt"] + task["canonical_solution"])(candidate)
    except AssertionError as e:
        return f"AssertionError: {e}" if str(e) else f"AssertionError at call {made[0]}"
    except Exception as e:  # noqa: BLE001 - a value of the wrong type making the test itself fail
        return f"{type(e).__name__}: {e}"[:300]
    return "" if made[0] == len(calls) else f"{made[0]} of {len(calls)} recorded calls made"


def score(task: dict, result) -> answers.Verdict:
    """The Verdict of a sandbox `result` of `program`: after a clean exit, whether `replay` accepts its values."""
    if not (result.status == "ok" and result.returncode == 0):
        return answers.score_unit_tests(result)
    values = outputs(result.stdout or "")
    if values is None:
        return answers.Verdict(0.0, "wrong", method="tests", reason="exited 0 before every recorded call returned")
    why = replay(task, values)
    return answers.Verdict(0.0 if why else 1.0, "wrong" if why else "ok", method="tests", reason=why[:300])
