"""PythonTool-v0: multi-turn math with a Python interpreter as a tool (PAL, arXiv:2211.10435; ToRA, arXiv:2309.17452).

Tasks ``{"question", "answer"}``: 3-digit arithmetic (`ArithmeticTasks`) by default, GSM8K with ``gsm8k_path``, or
any ``task_source``. The turn protocol: `PythonToolEnv`.
"""
from __future__ import annotations

from envs.tasks import arithmetic

from envs import base, sandbox
from envs.sandbox import workers as sandbox_workers

from envs.verify import answers
from envs.tasks import gsm8k
INSTRUCTION = ("\n\nYou can run Python: write code in a ```python block and you will see its output. "
               "When you know the answer, reply with it as \\boxed{answer}.")


class PythonToolEnv(base.QuestionAnswerEnv):
    """posttrain/PythonTool-v0: a turn with ``\\boxed{...}`` is the final answer; a turn with code runs it.

    A ``\\boxed{}`` turn ends the episode, scored by `answers.score_math` on the box only (its code is not run).
    Otherwise the FIRST ```python block runs in a fresh sandboxed interpreter and the next observation is its capped
    output. A turn with neither, or `max_turns` turns without an answer, end with reward 0; a sandbox infra_error
    ends the episode with status "infra_error".

    Args:
      task_source: any `TaskSource` of {"question", "answer"} tasks (overrides split and gsm8k_path).
      limits: `sandbox.Limits` per code run (default: 5 s CPU, 10 s wall, 512 MB, 64 KiB output).
      max_output_chars: cap on the tool output shown to the model (characters).
      workers: run code in persistent sandbox workers; False (or isolation "weak"): a fresh sandbox per run.
    Raises ValueError on bad arguments (max_turns < 2), TypeError when workers is not a bool.
    """

    instruction = INSTRUCTION

    def __init__(self, *, split: str = "train", task_source: base.TaskSource | None = None,
                 gsm8k_path: str | None = None, max_turns: int = 4, limits: sandbox.Limits | None = None,
                 max_output_chars: int = 2000, isolation: str = "strict", workers: bool = True,
                 self_check: bool = True) -> None:
        if not isinstance(workers, bool):
            raise TypeError(f"PythonToolEnv: workers must be a bool, got {workers!r}")
        if not isinstance(max_turns, int) or max_turns < 2:
            raise ValueError(f"PythonToolEnv: max_turns must be an int >= 2, got {max_turns!r}")
        if not isinstance(max_output_chars, int) or max_output_chars < 1:
            raise ValueError(f"PythonToolEnv: max_output_chars must be an int >= 1, got {max_output_chars!r}")
        if task_source is None:
            task_source = (gsm8k.GSM8KTasks(split, path=gsm8k_path) if gsm8k_path is not None else
                           arithmetic.ArithmeticTasks(split, digits=3, ops=("+", "-", "*"),
                                                      prompt="What is {a} {op} {b}?"))
        self.limits = limits if limits is not None else sandbox.Limits(
            cpu_s=5.0, wall_s=10.0, memory_mb=512, max_output_bytes=1 << 16)
        self.max_output_chars = max_output_chars
        self.isolation = isolation
        self.workers = workers and isolation == "strict"
        super().__init__(task_source, max_turns=max_turns, self_check=self_check)

    def turn_step(self, action: str) -> tuple[str, float, bool, dict]:
        gold = self.task["gold"]
        action = answers.strip_reasoning(answers.normalize_unicode(action), self.think_tags)
        if "\\boxed" in action or "\\fbox" in action:
            verdict = answers.score_math(action, gold, methods=("boxed",), think_tags=None)
            return "", verdict.reward, True, verdict.info()
        blocks = answers.extract_code_blocks(action, ("python", "py", "python3"))
        if not blocks:
            verdict = answers.Verdict(0.0, "wrong", gold=gold, reason="no code and no \\boxed{} answer")
            return "", 0.0, True, verdict.info()
        if self.workers:
            result = sandbox_workers.shared_pool(self.limits).run(blocks[0], limits=self.limits)
        else:
            result = sandbox.run(blocks[0], limits=self.limits, isolation=self.isolation)
        info = {"status": "ok", "gold": gold, "tool_status": result.status, "reason": result.reason}
        if result.status == "infra_error":
            return "", 0.0, True, {**info, "status": "infra_error"}
        return self.format_output(result), 0.0, False, info

    def format_output(self, result: sandbox.SandboxResult) -> str:
        """The observation shown after a code run: capped output, plus the status when not ok."""
        text = base.cap_text(result.stdout + result.stderr, self.max_output_chars)
        note = "" if result.status == "ok" else f"\n[{result.status}: {result.reason or 'no detail'}]"
        return f"```output\n{text}\n```{note}"

    def golden_answer(self, task: dict) -> str:
        return f"\\boxed{{{task['gold'] if 'gold' in task else answers.gold_answer(task['answer'])}}}"

    def golden_episodes(self) -> list[tuple[dict, list[str], float]]:
        episodes = super().golden_episodes()
        task = {"id": "selfcheck-tool", "question": "What is 6 * 7?", "answer": "42"}
        episodes.append((task, ["```python\nprint(6 * 7)\n```", "\\boxed{42}"], 1.0))
        episodes.append((task, ["#### 42"], 0.0))  # only \boxed{} ends an episode with an answer
        return episodes

    def self_check(self) -> None:
        """The golden episodes, plus: the tool's output reaches the next observation."""
        super().self_check()
        self.reset(options={"task": {"question": "What is 6 * 7?", "answer": "42"}})
        observation, _, terminated, _, info = self.step("```python\nprint(6 * 7)\n```")
        if terminated or "42" not in observation:
            raise RuntimeError(f"PythonToolEnv self-check failed: tool output not shown ({observation!r}, "
                               f"status={info.get('tool_status')!r}, reason={info.get('reason')!r})")
        self.task, self._done = None, True
