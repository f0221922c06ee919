"""HumanEval scored outside the candidate's process: the sandbox only runs the solution on recorded arguments;
the problem's own `check` runs here, on the values the solution returned.

Why: a test program that runs the candidate and `check` in one interpreter cannot keep a secret from it. Any
success marker the test prints after `check` returns can be read from the interpreter's frames and printed by
the candidate before it exits (``sys._getframe(1).f_locals['nonce']`` passed all 164 problems), and an object
whose comparisons say what the test wants passes the asserts themselves (157 of 164). Here neither the tests nor
the expected values are in the sandbox, and what comes out of it is data.

1. `recorded_calls`: `check(recorder)` runs once per problem in this process on the canonical solution (trusted
   dataset code); the recorder encodes the arguments of every call (`envs.verify.plain`) before the canonical
   solution answers it. The tests' `random` draws are seeded (`seeded_random`), so the calls repeat exactly.
2. `program`: the sandbox program. It defines the solution (prompt + completion, as assembled by the env), calls
   it on each recorded argument tuple in order and prints one line, `MARKER` + the JSON list of the encoded return
   values. Returning something that is not plain data is an error there (TypeError: reward 0).
3. `score`: the last `MARKER` line of a run that exited 0 is decoded into builtin values only, and `check` runs
   here again (the prompt's helpers and the canonical solution defined, `random` seeded as in 1) with a stand-in
   candidate that answers call
   i with value i, after checking that its arguments are the recorded call i. Reward 1 when every assert holds
   and every recorded call was made; an exit before the line, a malformed line or a failed assert scores 0.
   The solution can print any line it likes: to pass it must give the values the tests accept, i.e. solve the
   problem, without seeing the tests.
"""
from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import random

from envs.verify import answers as verifiers
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
    """The problem's `check` function, defined after `source`: the prompt's helpers (e.g. `poly`) and the canonical
    solution, which some tests call by name for the expected value (HumanEval/33: ``candidate(x) == sort_third(x)``;
    in one interpreter with the candidate that name was the candidate's own definition, and the assert vacuous)."""
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
    """The encoded argument tuples (`plain.dumps`) `task`'s check calls its candidate with, in order. Raises
    AssertionError if the canonical solution fails its own tests."""
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
    """"" when `check` accepts `values` as the answers to the recorded calls (module doc, step 3), else why not."""
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


def score(task: dict, result) -> verifiers.Verdict:
    """The Verdict of a sandbox `result` of `program`: the sandbox's own failures as `score_unit_tests` reads
    them; a run that exited 0 by whether `replay` accepts the values it printed."""
    if not (result.status == "ok" and result.returncode == 0):
        return verifiers.score_unit_tests(result)
    values = outputs(result.stdout or "")
    if values is None:
        return verifiers.Verdict(0.0, "wrong", method="tests", reason="exited 0 before every recorded call returned")
    why = replay(task, values)
    return verifiers.Verdict(0.0 if why else 1.0, "wrong" if why else "ok", method="tests", reason=why[:300])
