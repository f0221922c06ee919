"""Terminal-v0: multi-turn shell tasks in a sandboxed working directory (cf. InterCode-Bash, arXiv:2306.14898).

Checkers run on the host after the episode, seeing the workspace only through `Probe`, and hold their truth in
host memory, so a fake result file (``reward.txt``, ``PASSED``) gains nothing. Task dict: ``{"id", "instruction",
"files": {path: text}, "check": callable(Probe) -> (passed, reason)}``, or ``{"id"}`` of a built-in task.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from envs import base, sandbox

from envs.verify import answers
PROTOCOL = ("\n\nYou are in a Linux shell in an empty-ish working directory. Each reply may contain one "
            "```bash code block; it is run and you see its output. When the task is complete, reply with "
            "a line containing only DONE.")
REMINDER = "No ```bash block and no DONE line found. Send a ```bash block to run, or DONE when finished."
_DONE_RE = re.compile(r"^[ \t]*DONE[ \t]*$", re.M)
_FENCED_RE = re.compile(r"```.*?(?:```|\Z)", re.S)


class InfraError(RuntimeError):
    """The sandbox could not run a checker command (never scored as a wrong answer)."""


class Probe:
    """The checker's view of a workspace: run commands in it and read files, through the sandbox."""

    def __init__(self, workspace: sandbox.Workspace, limits: sandbox.Limits, isolation: str) -> None:
        self._workspace, self._limits, self._isolation = workspace, limits, isolation

    def run(self, argv: list[str], stdin: str | None = None) -> sandbox.SandboxResult:
        """Run `argv` in the workspace. Raises InfraError when the sandbox itself failed."""
        result = sandbox.run({}, argv, limits=self._limits, stdin=stdin, workspace=self._workspace,
                             isolation=self._isolation)
        if result.status == "infra_error":
            raise InfraError(result.reason or "sandbox infra_error")
        return result

    def read(self, path: str) -> str | None:
        """Text of workspace file `path` (read host-side, no symlink followed, at most 1 MiB), or None if unreadable."""
        try:
            return self._workspace.read_text(path)
        except (OSError, ValueError):
            return None


# --- built-in tasks: expected values are computed here, on the host --------------------------------

HELLO = "Hello, posttrain!"
LOG_LINES = [f"2024-03-{day:02d} {'ERROR disk full' if day % 4 == 1 else 'INFO ok'} id={day * 7}"
             for day in range(1, 29)] + ["2024-03-29 warning: error count rising", "2024-03-30 INFO ERROR-free"]
NAMES = ["mallory", "alice", "trent", "bob", "peggy", "carol", "victor", "dave"]
BUGGY_LIB = "def total(xs):\n    t = 0\n    for x in xs[1:]:\n        t += x\n    return t\n"
RUN_PY = "from lib import total\n\nprint(total([1, 2, 3]))\n"
HIDDEN_TOTALS = ([4, 5, 10], [], [7], [-2, 2, 9])


def _check_hello(probe: Probe) -> tuple[bool, str]:
    text = probe.read("hello.txt")
    if text is None:
        return False, "hello.txt missing"
    return (text.rstrip("\n") == HELLO), f"hello.txt holds {text[:60]!r}"


def _check_count(probe: Probe) -> tuple[bool, str]:
    expected = sum("ERROR" in line for line in LOG_LINES)
    text = probe.read("out.txt")
    if text is None:
        return False, "out.txt missing"
    return text.strip() == str(expected), f"out.txt holds {text.strip()[:40]!r}, expected {expected}"


def _check_sorted(probe: Probe) -> tuple[bool, str]:
    text = probe.read("sorted.txt")
    if text is None:
        return False, "sorted.txt missing"
    return text.split() == sorted(NAMES), f"sorted.txt holds {text.split()[:10]}"


def _check_fix(probe: Probe) -> tuple[bool, str]:
    shown = probe.run(["python3", "run.py"])
    if shown.status != "ok" or shown.stdout.strip() != "6":
        return False, f"python3 run.py printed {shown.stdout.strip()[:40]!r} ({shown.status})"
    hidden = f"from lib import total\nprint([total(xs) for xs in {list(HIDDEN_TOTALS)!r}])\n"
    result = probe.run(["python3", "-c", hidden])
    expected = str([sum(xs) for xs in HIDDEN_TOTALS])
    last = result.stdout.strip().splitlines()[-1:] or [""]
    return last[0] == expected, f"hidden cases gave {last[0][:60]!r}, expected {expected}"


def _check_tree(probe: Probe) -> tuple[bool, str]:
    init = probe.read("project/src/__init__.py")
    readme = probe.read("project/README.md")
    if init is None or readme is None:
        return False, "project/src/__init__.py or project/README.md missing"
    return (init == "" and "posttrain" in readme), "__init__.py must be empty and README.md mention posttrain"


BUILTIN_TASKS = [
    {"id": "hello-file", "files": {},
     "instruction": f"Create a file named hello.txt containing exactly the line: {HELLO}", "check": _check_hello},
    {"id": "count-errors", "files": {"log.txt": "\n".join(LOG_LINES) + "\n"},
     "instruction": "Count the lines of log.txt that contain the exact uppercase word ERROR and write the "
                    "count (just the number) to out.txt.", "check": _check_count},
    {"id": "sort-names", "files": {"names.txt": "\n".join(NAMES) + "\n"},
     "instruction": "Write the lines of names.txt, sorted alphabetically, to sorted.txt.", "check": _check_sorted},
    {"id": "fix-script", "files": {"run.py": RUN_PY, "lib.py": BUGGY_LIB},
     "instruction": "`python3 run.py` should print the sum of [1, 2, 3] but prints the wrong number. Fix the "
                    "bug in lib.py so that `python3 run.py` prints 6.", "check": _check_fix},
    {"id": "make-tree", "files": {},
     "instruction": "Create the directory project/src with an empty file project/src/__init__.py, and a file "
                    "project/README.md that mentions the word posttrain.", "check": _check_tree},
]
GOLDEN_COMMANDS = {
    "hello-file": f"echo '{HELLO}' > hello.txt",
    "count-errors": "grep -c ERROR log.txt > out.txt",
    "sort-names": "sort names.txt > sorted.txt",
    "fix-script": "sed -i 's/xs\\[1:\\]/xs/' lib.py && python3 run.py",
    "make-tree": "mkdir -p project/src && touch project/src/__init__.py && echo 'posttrain' > project/README.md",
}


class TerminalEnv(base.TextEnv):
    """posttrain/Terminal-v0: run each turn's shell commands in a private workspace until the model says DONE.

    A turn (its reasoning trace cut off) runs its FIRST ```bash/```sh block as ``bash -c`` in the workspace and
    sees the capped output and ``[exit code N]``. A line ``DONE`` outside code blocks ends the episode after that
    block; the checker then scores the workspace (1 or 0), as it does at truncation after `max_turns`.

    Args:
      tasks: task dicts (default: BUILTIN_TASKS); they form one split, "test".
      limits: `sandbox.Limits` per command (default: 5 s CPU, 10 s wall, 512 MB, 64 KiB output).
      max_output_chars: cap on the command output shown to the model (characters).
    Raises ValueError on a malformed task; reset() raises InfraError (a RuntimeError) when the sandbox cannot set
    up the workspace. close() removes the workspace.
    """

    think_tags = answers.THINK_TAGS  # reasoning trace cut off before commands and DONE are read (None: keep it)

    def __init__(self, *, tasks: list[dict] | None = None, max_turns: int = 8,
                 limits: sandbox.Limits | None = None, max_output_chars: int = 2000,
                 isolation: str = "strict", self_check: bool = True) -> None:
        self.limits = limits if limits is not None else sandbox.Limits(
            cpu_s=5.0, wall_s=10.0, memory_mb=512, max_output_bytes=1 << 16)
        self.max_output_chars, self.isolation = max_output_chars, isolation
        self._workspace: sandbox.Workspace | None = None
        source = base.ListTaskSource(tasks if tasks is not None else BUILTIN_TASKS, split="test", name="Terminal")
        super().__init__(source, max_turns=max_turns, self_check=self_check)

    def validate_task(self, task: dict) -> dict:
        if set(task) == {"id"}:
            matches = [t for t in BUILTIN_TASKS if t["id"] == task["id"]]
            if not matches:
                raise ValueError(f"TerminalEnv: unknown built-in task id {task['id']!r}; known: "
                                 f"{[t['id'] for t in BUILTIN_TASKS]}")
            task = dict(matches[0])
        base.require_keys(task, ("id", "instruction", "files", "check"), "TerminalEnv")
        if not callable(task["check"]) or not isinstance(task["files"], Mapping):
            raise ValueError("TerminalEnv: task['check'] must be callable and task['files'] a mapping")
        return task

    def first_observation(self, task: dict) -> str:
        self._close_workspace()
        self._workspace = sandbox.Workspace()
        self._workspace.__enter__()
        if task["files"]:
            result = sandbox.run(dict(task["files"]), ["true"], limits=self.limits,
                                 workspace=self._workspace, isolation=self.isolation)
            if result.status != "ok":
                raise InfraError(f"TerminalEnv: could not set up task {task['id']!r}: {result.reason}")
        return task["instruction"] + PROTOCOL

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        action = answers.strip_reasoning(action, self.think_tags)  # commands and DONE only after the trace
        blocks = answers.extract_code_blocks(action, ("bash", "sh", "shell"))
        done = bool(_DONE_RE.search(_FENCED_RE.sub("", action)))
        observation, info = REMINDER, {"status": "ok", "reason": ""}
        if blocks:
            result = sandbox.run({}, ["bash", "-c", blocks[0]], limits=self.limits,
                                 workspace=self._workspace, isolation=self.isolation)
            if result.status == "infra_error":
                return "", 0.0, True, {"status": "infra_error", "reason": result.reason}
            observation = self.format_output(result)
            info = {"status": "ok", "command_status": result.status, "reason": result.reason}
        if done:
            reward, info = self.score()
            return "", reward, True, info
        return observation, 0.0, False, info

    def format_output(self, result: sandbox.SandboxResult) -> str:
        """Observation after a command: capped output, exit code, and the status when not ok."""
        text = base.cap_text(result.stdout + result.stderr, self.max_output_chars)
        note = "" if result.status in ("ok", "runtime_error") else f" [{result.status}: {result.reason}]"
        return f"```output\n{text}\n```\n[exit code {result.returncode}]{note}"

    def score(self) -> tuple[float, dict]:
        """Run the task's checker on the workspace: (reward, info)."""
        probe = Probe(self._workspace, self.limits, self.isolation)
        try:
            passed, reason = self.task["check"](probe)
        except InfraError as exc:
            return 0.0, {"status": "infra_error", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a workspace the checker cannot parse is a failure
            passed, reason = False, f"checker error: {exc!r}"
        verdict = answers.Verdict(float(bool(passed)), "ok" if passed else "wrong", method="checker",
                                    reason="" if passed else reason)
        return verdict.reward, verdict.info()

    def on_truncate(self, reward: float, info: dict) -> tuple[float, dict]:
        reward, info = self.score()
        return reward, {**info, "reason": (info["reason"] + "; " if info["reason"] else "") + "max_turns reached"}

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        """The built-in fix-script task: the real fix scores 1; faking result files scores 0."""
        task = next(t for t in BUILTIN_TASKS if t["id"] == "fix-script")
        return [(task, [f"```bash\n{GOLDEN_COMMANDS['fix-script']}\n```", "DONE"], 1.0),
                (task, ["```bash\necho 1 > reward.txt; echo PASSED > result.txt\n```\nDONE"], 0.0)]

    def _close_workspace(self) -> None:
        if self._workspace is not None:
            self._workspace.__exit__(None, None, None)
            self._workspace = None

    def close(self) -> None:
        self._close_workspace()
        super().close()

    def __del__(self) -> None:
        try:
            self._close_workspace()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
