"""posttrain/RepoFix-v0: repair a small Python repository through tool calls; reward 1 when every hidden test passes.

Each turn's tool calls (`envs.tasks.repo_fix.tools`) run in the episode's workspace and their results form the
next observation. The episode ends on ``submit``, `max_turns` or `wall_budget_s` (scored), or after `max_malformed`
turns without a well-formed call (reward 0). The protocol and the final info in full: docs/repo_fix.md.
"""
from __future__ import annotations

import time

from envs import base, sandbox
from envs.tasks.repo_fix import scoring, tools
from envs.tasks.repo_fix.session import InfraError, Session
from envs.tasks.repo_fix.tasks import RepoFixTasks
from envs.verify import answers

ENV_ID = "posttrain/RepoFix-v0"
INSTRUCTION = """You are fixing a Python repository: your current directory. Its package `toolbox` does not do \
what its documentation (README.md and the docstrings) says, and some tests in tests/ fail. Find the cause, fix the \
package's code, and call the submit tool when you are done. Hidden tests of the documented behaviour decide whether \
the fix is right; the files in tests/ are put back as they were before those run, so change the package, not the \
tests.

Repository files:
{files}

Run the tests with: python tests/run_tests.py

{tools}"""
REMINDER = ('Call a tool as <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>; '
            "call submit when the fix is done.")


def response(name: str, text: str) -> str:
    """One tool result as it appears in the observation."""
    return f'<tool_response name="{name}">\n{text}\n</tool_response>'


class RepoFixEnv(base.TextEnv):
    """posttrain/RepoFix-v0 (protocol in the module docstring).

    Args:
      seed: the task source's seed (visible/hidden split, defects); task_source overrides split and seed.
      max_turns: model turns before the episode is truncated and scored (>= 2).
      max_malformed: turns in a row without a well-formed tool call that end the episode (>= 1).
      wall_budget_s: seconds from reset after which the episode ends at the next turn (scored).
      run_limits: `sandbox.Limits` of one ``run`` call (default: 20 s wall and CPU, 1 GiB, 256 KiB output).
      max_output_chars: cap on one tool result shown to the model (characters).
    Raises ValueError on bad arguments; reset() raises InfraError (a RuntimeError) when the workspace cannot be set up.
    """

    think_tags = answers.THINK_TAGS
    tool_schemas = tools.TOOLS  # OpenAI-style function schemas, for chat templates that render tools

    def __init__(self, *, split: str = "train", seed: int = 0, task_source: base.TaskSource | None = None,
                 max_turns: int = 20, max_malformed: int = 3, wall_budget_s: float = 900.0,
                 run_limits: sandbox.Limits | None = None, max_output_chars: int = 4000, isolation: str = "strict",
                 self_check: bool = True) -> None:
        if not isinstance(max_turns, int) or max_turns < 2:
            raise ValueError(f"RepoFixEnv: max_turns must be an int >= 2, got {max_turns!r}")
        if not isinstance(max_malformed, int) or max_malformed < 1:
            raise ValueError(f"RepoFixEnv: max_malformed must be an int >= 1, got {max_malformed!r}")
        if not wall_budget_s > 0:
            raise ValueError(f"RepoFixEnv: wall_budget_s must be > 0, got {wall_budget_s!r}")
        self.run_limits = run_limits if run_limits is not None else sandbox.Limits(
            cpu_s=20.0, wall_s=20.0, memory_mb=1024, max_output_bytes=1 << 18)
        self.max_malformed, self.wall_budget_s = max_malformed, float(wall_budget_s)
        self.max_output_chars, self.isolation = max_output_chars, isolation
        self._session: Session | None = None
        self._reset_counters()
        source = task_source if task_source is not None else RepoFixTasks(split, seed=seed, isolation=isolation)
        super().__init__(source, max_turns=max_turns, self_check=self_check)

    def _reset_counters(self) -> None:
        self._started, self._streak, self._malformed, self._calls = time.monotonic(), 0, 0, 0

    def validate_task(self, task: dict) -> dict:
        base.require_keys(task, ("id", "files", "original_files", "suites", "golden_patch"), "RepoFixEnv")
        return task

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        observation, info = super().reset(seed=seed, options=options)
        return observation, {**info, "tools": self.tool_schemas, "tools_prompt": tools.tools_prompt()}

    def first_observation(self, task: dict) -> str:
        self._close_session()
        self._session = Session(task["files"], run_limits=self.run_limits, max_output_chars=self.max_output_chars,
                                isolation=self.isolation)
        self._reset_counters()
        listing = "\n".join(f"  {p}" for p in sorted(task["files"]))
        return INSTRUCTION.format(files=listing, tools=tools.tools_prompt())

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        if time.monotonic() - self._started > self.wall_budget_s:
            return ("", *self.score("wall_budget"))
        calls, errors = tools.parse_tool_calls(answers.strip_reasoning(action, self.think_tags))
        self._malformed += len(errors) + (0 if calls or errors else 1)
        if not calls:
            self._streak += 1
            if self._streak >= self.max_malformed:
                return "", 0.0, True, self._unscored(f"{self._streak} turns in a row without a well-formed tool call")
            problems = "\n".join(f"error: {e}" for e in errors) or "error: no tool call found in the reply"
            text = f"{problems}\n{REMINDER}"
            return response("error", text), 0.0, False, self._step_info(errors, [("user", "error", text)])
        self._streak = 0
        results = [("tool", "error", f"error: {e}") for e in errors]
        for call in calls[:tools.MAX_CALLS_PER_TURN]:
            self._calls += 1
            if call.name == "submit":
                return ("", *self.score("submit"))
            try:
                results.append(("tool", call.name, self._session.execute(call)))
            except InfraError as exc:
                return "", 0.0, True, {"status": "infra_error", "reason": str(exc), **self._counts()}
            if time.monotonic() - self._started > self.wall_budget_s:
                return ("", *self.score("wall_budget"))
        if len(calls) > tools.MAX_CALLS_PER_TURN:
            results.append(("tool", "error", f"only the first {tools.MAX_CALLS_PER_TURN} calls of a turn run"))
        observation = "\n".join(response(name, text) for _, name, text in results)
        return observation, 0.0, False, self._step_info(errors, results)

    def _counts(self) -> dict:
        return {"tool_calls": self._calls, "malformed_calls": self._malformed,
                "elapsed_s": time.monotonic() - self._started}

    def _step_info(self, errors: list[str], results: list[tuple[str, str, str]]) -> dict:
        messages = [{"role": role, "content": text, **({"name": name} if role == "tool" else {})}
                    for role, name, text in results]
        return {"status": "ok", "reason": "; ".join(errors), "messages": messages, **self._counts()}

    def _task_info(self) -> dict:
        return {"defects": self.task.get("defects"), "difficulty": self.task.get("difficulty")}

    def _unscored(self, reason: str) -> dict:
        verdict = answers.Verdict(0.0, "wrong", method="hidden_tests", reason=reason)
        diff = scoring.final_diff(self.task["files"], self._session.snapshot())
        return {**verdict.info(), "ended_by": "malformed", "diff": diff, **self._counts(), **self._task_info()}

    def score(self, ended_by: str) -> tuple[float, bool, dict]:
        """Score the workspace now: (reward, terminated=True, info)."""
        reward, info = scoring.score(self.task, self._session.snapshot(), isolation=self.isolation)
        return reward, True, {**info, "ended_by": ended_by, **self._counts(), **self._task_info()}

    def on_truncate(self, reward: float, info: dict) -> tuple[float, dict]:
        reward, _, info = self.score("max_turns")
        return reward, info

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        """Task 0: golden patch then submit scores 1; submitting unchanged, or replies without tool calls, score 0."""
        task = self.task_source.get_task(0)
        submit = tools.format_call("submit")
        return [(task, [tools.format_call("apply_patch", patch=task["golden_patch"]), submit], 1.0),
                (task, [submit], 0.0), (task, ["I will fix it."] * self.max_malformed, 0.0)]

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        """Remove the workspace (an env dropped without close() frees it when garbage-collected, `Session`)."""
        self._close_session()
        super().close()


def golden_status(seed: int = 0) -> tuple[str, str, str, str]:
    """(status, source, reason, sample) of the domain's golden check for `posttrain domains`.

    "verified" when a fresh train env passes its self-check (`RepoFixEnv.golden_episodes`), else "failed"."""
    counts = {split: RepoFixTasks(split, seed=seed).num_tasks for split in ("train", "test")}
    sample = f"{ENV_ID}: {counts['train']} train / {counts['test']} test tasks (HumanEval problems with defects)"
    try:
        RepoFixEnv(split="train", seed=seed).close()
    except RuntimeError as exc:
        return "failed", "inverse patch via apply_patch", str(exc), sample
    return "verified", "inverse patch via apply_patch", "", sample
