"""Tamper-proof RepoFix-v0 scoring: reward 1 when every hidden test passes (SWE-bench's *resolved*, arXiv:2310.06770).

Nothing the model wrote is trusted: `scoring_files` drops hook files and restores the original tests/; a FRESH
sandbox (never a pooled worker) runs the trusted runner (`sandboxed` ``score`` mode) with the hidden tests and a
random nonce on stdin, never as files; only its ``<nonce> <json>`` line counts, not files or exit codes.
"""
from __future__ import annotations

import difflib
import functools
import json
import pathlib
import posixpath
import secrets

from envs import base, sandbox
from envs.tasks.repo_fix import sandboxed
from envs.verify import answers

HOOK_NAMES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})
CASE_S = 5.0  # wall seconds per test case (all its calls together)
LIMITS = sandbox.Limits(cpu_s=60.0, wall_s=120.0, memory_mb=1536, max_procs=16, max_output_bytes=1 << 20)
MAX_DIFF_CHARS = 20_000


@functools.lru_cache(maxsize=1)
def program() -> str:
    """Source of `envs.tasks.repo_fix.sandboxed`, the program run inside the sandbox."""
    return pathlib.Path(sandboxed.__file__).read_text()


def run_program(mode: str, payload: dict, files: dict, limits: sandbox.Limits, isolation: str) -> sandbox.SandboxResult:
    """Run `sandboxed` in `mode` in a fresh sandbox holding `files`, with `payload` (JSON) on stdin."""
    argv = [sandbox.PYTHON, "-I", "-S", "-c", program(), mode]
    return sandbox.run(files, argv, limits=limits, stdin=json.dumps(payload) + "\n", isolation=isolation)


def is_hook(path: str) -> bool:
    """Whether `path` is a file Python or a test framework runs on its own (hooks a cheat could use)."""
    name = posixpath.basename(path)
    parts = path.split("/")
    return name in HOOK_NAMES or name.endswith((".pth", ".pyc")) or "__pycache__" in parts


def _in_tests(path: str) -> bool:
    return path.split("/", 1)[0] == "tests"


def scoring_files(snapshot: dict[str, bytes], task: dict) -> tuple[dict[str, bytes], list[str], bool]:
    """(files to score, hook files removed, whether tests/ had changed): no hooks, the task's original tests/."""
    hooks = sorted(p for p in snapshot if is_hook(p))
    originals = {p: t.encode() for p, t in task["original_files"].items() if _in_tests(p)}
    current = {p: d for p, d in snapshot.items() if _in_tests(p)}
    files = {p: d for p, d in snapshot.items() if p not in hooks and not _in_tests(p)}
    return {**files, **originals}, hooks, current != originals


def final_diff(initial: dict[str, str], snapshot: dict[str, bytes], max_chars: int = MAX_DIFF_CHARS) -> str:
    """Unified diff from the task's files to the final workspace (text files; binary ones named only), capped."""
    chunks = []
    for path in sorted(set(initial) | set(snapshot)):
        if path.endswith(".pyc"):
            continue
        old = initial.get(path)
        data = snapshot.get(path)
        try:
            new = None if data is None else data.decode()
        except UnicodeDecodeError:
            chunks.append(f"Binary file b/{path} differs\n")
            continue
        if old != new:
            chunks.extend(difflib.unified_diff(
                (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
                "/dev/null" if old is None else f"a/{path}", "/dev/null" if new is None else f"b/{path}"))
    return base.cap_text("".join(chunks), max_chars)


def _parse(stdout: str, nonce: str) -> dict | None:
    for line in reversed(stdout.splitlines()):  # the runner's line is its last
        if line.startswith(nonce + " "):
            try:
                return json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
    return None


def _verdict(result: sandbox.SandboxResult, outcome: dict | None, n_hidden: int) -> answers.Verdict:
    if result.status == "infra_error" or (outcome is None and sandboxed.NOT_DUMPABLE_FAILED in result.stderr):
        reason = result.reason or result.stderr[-300:]
        return answers.Verdict(0.0, "infra_error", method="hidden_tests", reason=reason)
    if outcome is None:
        status = result.status if result.status != "ok" else "wrong"
        return answers.Verdict(0.0, status, method="hidden_tests",
                                 reason=f"the test run gave no result ({result.status}: {result.reason})")
    hidden = [ok for suite in outcome["hidden"] for ok in suite]
    if len(hidden) == n_hidden and all(hidden):
        return answers.Verdict(1.0, "ok", method="hidden_tests")
    return answers.Verdict(0.0, "wrong", method="hidden_tests",
                             reason=f"{len(hidden) - sum(hidden)} of {n_hidden} hidden tests fail")


def score(task: dict, snapshot: dict[str, bytes], *, limits: sandbox.Limits = LIMITS, isolation: str = "strict",
          case_s: float = CASE_S) -> tuple[float, dict]:
    """(reward, info) of the workspace `snapshot` ({path: bytes}) for `task`.

    info: the `Verdict` fields, hidden_passed / hidden_total / hidden_pass_fraction, visible_passed / visible_total,
    removed (hook files dropped), tests_restored, diff (capped at MAX_DIFF_CHARS), score_wall_s."""
    files, removed, tests_changed = scoring_files(snapshot, task)
    nonce = secrets.token_hex(16)
    suites = task["suites"]
    payload = {"program": program(), "nonce": nonce, "case_s": case_s, "visible": suites["visible"],
               "hidden": suites["hidden"]}
    result = run_program("score", payload, files, limits, isolation)
    outcome = _parse(result.stdout, nonce)
    n_hidden = sum(len(s["cases"]) for s in suites["hidden"])
    n_visible = sum(len(s["cases"]) for s in suites["visible"])
    verdict = _verdict(result, outcome, n_hidden)
    hidden_passed = sum(sum(s) for s in outcome["hidden"]) if outcome else 0
    visible_passed = sum(sum(s) for s in outcome["visible"]) if outcome else 0
    info = {**verdict.info(), "hidden_passed": hidden_passed, "hidden_total": n_hidden,
            "hidden_pass_fraction": hidden_passed / n_hidden if n_hidden else 0.0,
            "visible_passed": visible_passed, "visible_total": n_visible, "removed": removed,
            "tests_restored": tests_changed,
            "diff": final_diff(task["files"], snapshot), "score_wall_s": result.wall_s}
    return verdict.reward, info
