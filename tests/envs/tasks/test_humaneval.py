"""Tests for envs/code.py (HumanEval-v0). A few problems here; all 164 in the slow test and the bench."""
import json

import pytest

from envs.tasks import humaneval

from envs import sandbox
PROBLEMS = humaneval.load_problems()


@pytest.fixture(scope="module")
def env():
    return humaneval.HumanEvalEnv()  # the self-check runs HumanEval/0 twice in the sandbox


def _score(env, task, completion):
    env.reset(options={"task": task})
    _, reward, terminated, truncated, info = env.step(completion)
    assert terminated and not truncated
    return reward, info


def test_problems_come_from_the_package_in_order():
    assert len(PROBLEMS) == 164
    assert [p["task_id"] for p in PROBLEMS[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert {"prompt", "canonical_solution", "test", "entry_point"} <= set(PROBLEMS[0])
    with pytest.raises(FileNotFoundError, match="nope"):
        humaneval.load_problems("/nope.jsonl.gz")
    with pytest.raises(ValueError, match="test"):
        humaneval.HumanEvalTasks("train")


def test_assemble_solution_variants():
    task = PROBLEMS[2]  # truncate_number(number: float) -> float: return number % 1.0
    body = "    return number % 1.0\n"
    full = f"Sure!\n```python\ndef truncate_number(number: float) -> float:\n{body}```\nDone."
    assert humaneval.assemble_solution(task, body).startswith(task["prompt"] + body)
    assert "\n\ndef truncate_number" in humaneval.assemble_solution(task, full)
    unindented = humaneval.assemble_solution(task, "return number % 1.0")
    assert task["prompt"] + "    return number % 1.0" in unindented
    assert humaneval.assemble_solution(task, full).rstrip().endswith("return number % 1.0")  # no tests in it


@pytest.mark.parametrize("index", [0, 2, 12, 53])
def test_canonical_solutions_pass_as_body_or_full_function(env, index):
    task = PROBLEMS[index]
    assert _score(env, task, task["canonical_solution"])[0] == 1.0
    fenced = f"Here you go:\n```python\n{task['prompt']}{task['canonical_solution']}```\n"
    reward, info = _score(env, task, fenced)
    assert reward == 1.0 and info["status"] == "ok"


@pytest.mark.parametrize("completion,status", [
    ("", "wrong"), ("    return 0.5\n", "wrong"), ("    return undefined_name\n", "runtime_error"),
    ("    return (\n", "runtime_error"), ("I cannot solve this.", "runtime_error")])
def test_wrong_completions_score_zero_with_status(env, completion, status):
    reward, info = _score(env, PROBLEMS[2], completion)
    assert reward == 0.0 and info["status"] == status and info["reason"]


def test_limits_are_enforced():
    env = humaneval.HumanEvalEnv(limits=sandbox.Limits(cpu_s=1.0, wall_s=2.0, max_output_bytes=1 << 12))
    reward, info = _score(env, PROBLEMS[2], "    while True:\n        pass\n")
    assert reward == 0.0 and info["status"] == "timeout"
    reward, info = _score(env, PROBLEMS[2], "    print('x' * 100000)\n    return number % 1.0\n")
    assert reward == 0.0 and info["status"] == "output_limit"


@pytest.mark.parametrize("cheat", ["import sys; sys.exit(0)", "import os; os._exit(0)",
                                   "raise SystemExit(0)", "print('ok')"])
def test_exiting_early_with_status_zero_does_not_pass(env, cheat):
    reward, info = _score(env, PROBLEMS[2], f"    {cheat}\n")
    assert reward == 0.0 and info["status"] in ("wrong", "runtime_error")


@pytest.mark.slow
def test_all_canonical_solutions_pass(env):
    failures = [p["task_id"] for p in PROBLEMS if _score(env, p, p["canonical_solution"])[0] != 1.0]
    assert failures == []


GOOD, BAD = PROBLEMS[2]["canonical_solution"], "    return 0.5\n"  # truncate_number: body that passes / fails


def _fence(body):
    return f"```python\n{PROBLEMS[2]['prompt']}{body}```"


# reply -> reward: only the reply after the last </think> is read
@pytest.mark.parametrize("reply,think_tags,reward", [
    (f"<think>draft:\n{_fence(BAD)}</think>\n{_fence(GOOD)}", humaneval.HumanEvalEnv.think_tags, 1.0),
    (f"<think>draft:\n{_fence(GOOD)}</think>\n{_fence(BAD)}", humaneval.HumanEvalEnv.think_tags, 0.0),
    (f"<think>\n{_fence(GOOD)}</think>Sorry, no idea.", humaneval.HumanEvalEnv.think_tags, 0.0),
    (f"<think>still thinking\n{_fence(GOOD)}", humaneval.HumanEvalEnv.think_tags, 0.0),  # cut off inside the trace
    (f"<think>a</think><think>\n{_fence(GOOD)}</think>{GOOD}", humaneval.HumanEvalEnv.think_tags, 1.0),  # raw body after
    (f"<think>\n{_fence(GOOD)}\n</think>", None, 1.0),  # turned off: the whole reply is read
    (_fence(GOOD), humaneval.HumanEvalEnv.think_tags, 1.0),  # no trace
])
def test_code_is_read_after_the_reasoning_trace(reply, think_tags, reward):
    env = humaneval.HumanEvalEnv(self_check=False)
    env.think_tags = think_tags
    assert _score(env, PROBLEMS[2], reply)[0] == reward


def test_runs_in_persistent_workers_by_default_or_fresh_on_request(env):
    from envs.sandbox import workers

    pool = workers.shared_pool(env.limits)
    assert env.workers and pool.workers  # the self-check already ran in a worker
    servers = {w.server_pid for w in pool.workers}
    assert _score(env, PROBLEMS[2], PROBLEMS[2]["canonical_solution"])[0] == 1.0
    assert {w.server_pid for w in pool.workers} == servers  # the same worker ran it
    fresh = humaneval.HumanEvalEnv(workers=False)  # a fresh sandbox and interpreter per run (its self-check too)
    assert not fresh.workers and _score(fresh, PROBLEMS[2], PROBLEMS[2]["canonical_solution"])[0] == 1.0
    assert _score(fresh, PROBLEMS[2], "    return 0.5\n")[1]["status"] == "wrong"
    assert not humaneval.HumanEvalEnv(isolation="weak", self_check=False).workers
    with pytest.raises(TypeError, match="workers"):
        humaneval.HumanEvalEnv(workers="yes")


ALWAYS_EQUAL = '''```python
class _U:
    def __eq__(s, o): return True
    def __ne__(s, o): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __bool__(s): return True
    def __sub__(s, o): return 0
    __rsub__ = __sub__
    def __abs__(s): return 0
def {ep}(*a, **k): return _U()
```'''


FRAME_NONCE = """```python
import sys, os
try:
    n = sys._getframe(1).f_locals["nonce"]
except Exception:
    n = "x"
sys.stdout.write("\\n" + n + "\\n"); sys.stdout.flush(); os._exit(0)
```"""


@pytest.mark.parametrize("index", [0, 2, 32, 33, 38, 53, 120])
def test_replies_that_game_an_in_process_test_score_0_and_the_canonical_solution_1(env, index):
    """An object that equals anything passed 157 of 164 tests and a success marker read from the test's frame all
    164, while the tests ran in the candidate's interpreter; now they run here on its returned values
    (`humaneval_io`). Problems 32, 38 and 53 draw random inputs, 33 and 38 call helpers or the function itself in
    their asserts; the canonical solution passes (all 164: a sweep in the session note)."""
    task = env.task_source.get_task(index)
    rewards = []
    for reply in (ALWAYS_EQUAL.format(ep=task["entry_point"]), FRAME_NONCE, task["canonical_solution"]):
        env.reset(seed=0, options={"task": task})
        _, reward, _, _, info = env.step(reply)
        rewards.append((reward, info["status"]))
    assert [r for r, _ in rewards] == [0.0, 0.0, 1.0] and rewards[2][1] == "ok", rewards


def test_replay_reads_only_plain_values_and_checks_each_call():
    from envs.tasks import humaneval_io

    task = PROBLEMS[2]  # truncate_number(3.5) == 0.5, ...
    calls = humaneval_io.recorded_calls(task)
    right = [humaneval_io.plain.loads(c)[0] % 1.0 for c in calls]
    assert humaneval_io.replay(task, right) == ""
    assert humaneval_io.replay(task, right[:-1]).startswith(f"{len(calls) - 1} return values for {len(calls)} calls")
    assert humaneval_io.replay(task, [0.25] * len(calls)).startswith("AssertionError")
    line = humaneval_io.MARKER + json.dumps([humaneval_io.plain.dumps(v) for v in right])
    assert humaneval_io.outputs("noise\n" + line + "\n") == right
    for bad in ("[1, 2]", '["{\\"q\\": 1}"]', "not json", "[" * 100_000):
        assert humaneval_io.outputs(humaneval_io.MARKER + bad) is None
