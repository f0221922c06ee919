"""Tests for envs/tool.py (PythonTool-v0): the multi-turn code-then-\\boxed{} protocol."""
import json

import pytest

from envs import base, sandbox
from envs.tasks.python_tool import PythonToolEnv

TASK = {"id": "t", "question": "What is 123 * 456?", "answer": "56088"}
CODE = "```python\nprint(123 * 456)\n```"


@pytest.fixture(scope="module")
def env():
    return PythonToolEnv(max_turns=3)


def test_code_then_boxed_answer(env):
    obs, _ = env.reset(options={"task": TASK})
    assert obs.startswith(TASK["question"]) and "\\boxed" in obs and "```python" in obs
    obs, reward, terminated, truncated, info = env.step("Let me compute.\n" + CODE)
    assert "56088" in obs and obs.startswith("```output") and (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_status"] == "ok"
    _, reward, terminated, truncated, info = env.step("So the product is \\boxed{56,088}.")
    assert (reward, terminated, truncated, info["status"], info["extracted"]) == (1.0, True, False, "ok", "56,088")


def test_only_boxed_counts_as_a_final_answer(env):
    env.reset(options={"task": TASK})
    _, reward, terminated, _, info = env.step("The answer is 56088.")
    assert (reward, terminated, info["status"]) == (0.0, True, "wrong") and "no code" in info["reason"]
    env.reset(options={"task": TASK})
    _, reward, terminated, _, info = env.step("\\boxed{56089}")
    assert (reward, terminated, info["status"], info["gold"]) == (0.0, True, "wrong", "56088")


def test_max_turns_truncates_with_zero_reward(env):
    env.reset(options={"task": TASK})
    for turn in range(3):
        _, reward, terminated, truncated, info = env.step(CODE)
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, True, 3)
    assert "max_turns" in info["reason"]


def test_tool_errors_are_shown_not_fatal():
    env = PythonToolEnv(max_turns=4, max_output_chars=100,
                        limits=sandbox.Limits(cpu_s=1.0, wall_s=2.0, max_output_bytes=1 << 14))
    env.reset(options={"task": TASK})
    obs, _, terminated, _, info = env.step("```python\n1/0\n```")
    assert "ZeroDivisionError" in obs and not terminated and info["tool_status"] == "runtime_error"
    obs, _, terminated, _, _ = env.step("```python\nprint('y' * 1000)\n```")
    assert "characters truncated" in obs and len(obs) < 250 and not terminated
    obs, _, terminated, _, info = env.step("```python\nwhile True: pass\n```")
    assert info["tool_status"] == "timeout" and "[timeout" in obs and not terminated


def test_state_does_not_persist_between_runs(env):
    env.reset(options={"task": TASK})
    env.step("```python\nx = 5\nimport math\nmath.pi = 3\nopen('f.txt', 'w').write('kept?')\n```")
    obs, *_ = env.step("```python\nimport math, os\nprint(math.pi, os.listdir('.'))\nprint(x)\n```")
    assert "NameError" in obs and "3.14159" in obs and "f.txt" not in obs, obs


@pytest.mark.parametrize("workers", [True, False])
def test_code_runs_in_persistent_workers_or_a_fresh_sandbox(env, workers):
    tool = env if workers else PythonToolEnv(max_turns=3, workers=False)  # its self-check runs fresh sandboxes
    assert tool.workers is workers
    tool.reset(options={"task": TASK})
    obs, *_ = tool.step(CODE)
    assert "56088" in obs
    with pytest.raises(TypeError, match="workers"):
        PythonToolEnv(workers=1)


def test_default_and_gsm8k_task_sources(tmp_path):
    default = PythonToolEnv(split="test", self_check=False)
    obs = default.reset(seed=0)[0]
    assert default.task_source.split == "test" and obs.startswith("What is ") and "just the number" not in obs
    row = {"question": "Tom has 3 boxes of 12 pens. How many pens?", "answer": "3 * 12 = 36\n#### 36"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    env = PythonToolEnv(gsm8k_path=str(tmp_path), self_check=False)
    env.reset(seed=0)
    assert env.step("\\boxed{36}")[1] == 1.0
    with pytest.raises(ValueError, match="max_turns"):
        PythonToolEnv(max_turns=1)
    assert isinstance(env.task_source, base.TaskSource)
