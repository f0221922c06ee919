"""The code_tests verifier: a reply's last ```python block run with a task-file row's tests in the sandbox.

The runner comes from the caller (`envs.tasks.task_file.run_code`): the verify layer does not import the sandbox.
Rules: `verify_code_tests` and docs/verifiers.md.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from envs.verify import answers
from envs.verify.row_verifiers import _clean, _fail

CodeRunner = Callable[[str, float], Any]  # (program source, seconds) -> an `envs.sandbox.SandboxResult` (duck-typed)


def code_program(code: str, tests: str, entry_point: str | None, marker: str) -> str:
    """The program code_tests runs: the code, the tests, maybe ``check(entry_point)``, then a print of `marker`.

    ``check(entry_point)`` is added when the tests define ``check`` at column 0 and never call it (HumanEval
    style); the marker printed last is the proof that the tests finished."""
    call = ""
    defines_check = re.search(r"^def check\s*\(", tests, re.MULTILINE)
    if entry_point and defines_check and not re.search(r"^\s*check\s*\(", tests, re.MULTILINE):
        call = f"check({entry_point})\n"
    return f"{code}\n\n\n{tests}\n{call}print({marker!r}, flush=True)\n"


def verify_code_tests(reply, row, *, timeout_s=10.0, bound_s=answers.DEFAULT_TIMEOUT_S,
                      code_runner: CodeRunner | None = None) -> answers.Verdict:
    """Reward 1 when the reply's last ```python block passes row["tests"] (Python with asserts) in the sandbox.

    The block (tag python, py or python3; read after `strip_reasoning`, never normalised) must define
    row["entry_point"] when the row gives one (``def``/``class`` at a line start, or an assignment at column 0).
    `code_program` joins code and tests; `code_runner(program, timeout_s)` runs it (an `envs.sandbox.run` with
    cpu_s = wall_s = timeout_s). Status from `answers.score_unit_tests`; a program that exits 0 before the tests
    end (``sys.exit(0)``) lacks the random marker and scores 0. No runner, or one that raises: "infra_error".
    The program and the tests share one process, so code that reads its own source could still cheat."""
    text, why = _clean(reply, normalize=False)
    if text is None:
        return _fail(why, method="tests")
    blocks = answers.extract_code_blocks(text, ("python", "py", "python3"))
    if not blocks:
        return _fail("no ```python block", method="tests")
    code, entry = blocks[-1], row.get("entry_point")
    defines = rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(entry or '')}\b|^{re.escape(entry or '')}[ \t]*="
    if entry and not re.search(defines, code, re.MULTILINE):
        return _fail(f"the code does not define {entry!r}", method="tests")
    if code_runner is None:
        return _fail("no code runner given (score(..., code_runner=...))", method="tests", status="infra_error")
    marker = "code-tests-finished-" + secrets.token_hex(16)
    try:
        result = code_runner(code_program(code, row["tests"], entry, marker), float(timeout_s))
    except Exception as exc:  # noqa: BLE001 - bubblewrap missing, no user namespaces: the harness, not the reply
        return _fail(f"sandbox: {exc!r}", method="tests", status="infra_error")
    verdict = answers.score_unit_tests(result)
    if verdict.reward == 1.0 and marker not in (getattr(result, "stdout", "") or ""):
        return _fail("the program exited before its tests finished", method="tests")
    return verdict
