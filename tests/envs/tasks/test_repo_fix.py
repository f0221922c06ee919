"""Tests for envs/tasks/repo_fix/env.py (RepoFix-v0): scripted and do-nothing agents, the episode's end conditions,
and a table of tampering strategies that must all score 0 (sandbox runs are the cost: few tasks by default, 50
under the slow mark)."""
import ast
import time

import gymnasium
import pytest

import envs
from envs.tasks import domains
from envs.tasks.repo_fix import tools
from envs.tasks.repo_fix.env import ENV_ID, RepoFixEnv
from envs.tasks.repo_fix.tasks import RepoFixTasks

call = tools.format_call
RUN_TESTS = call("run", command="python tests/run_tests.py")
SUBMIT = call("submit")


@pytest.fixture(scope="module")
def env():
    env = RepoFixEnv(split="train")  # runs the golden self-check
    yield env
    env.close()


@pytest.fixture(scope="module")
def test_env(env):
    env = RepoFixEnv(split="test", self_check=False)
    yield env
    env.close()


def scripted_agent(env, task) -> tuple[float, dict, list[str]]:
    """Reads the failing tests, applies the inverse patch through apply_patch, checks the tests, submits."""
    observations = [env.reset(options={"task": task})[0]]
    for action in (RUN_TESTS, call("apply_patch", patch=task["golden_patch"]), RUN_TESTS, SUBMIT):
        obs, reward, terminated, truncated, info = env.step(action)
        observations.append(obs)
        if terminated or truncated:
            break
    return reward, info, observations


def check_resolved(env, task) -> None:
    reward, info, obs = scripted_agent(env, task)
    assert "FAIL" in obs[1] and "[exit code 1" in obs[1], obs[1]
    assert obs[2].startswith('<tool_response name="apply_patch">\napplied: ')
    assert " 0 failed" in obs[3] and "[exit code 0" in obs[3], obs[3]
    assert (reward, info["status"], info["ended_by"]) == (1.0, "ok", "submit"), info
    assert info["hidden_pass_fraction"] == 1.0 and info["visible_passed"] == info["visible_total"] > 0
    assert info["diff"] == task["golden_patch"]  # the final diff is exactly the inverse patch


def check_unresolved_when_nothing_is_done(env, task) -> None:
    reward, info = env.play(task, [SUBMIT])
    assert (reward, info["status"]) == (0.0, "wrong"), info
    assert info["hidden_passed"] < info["hidden_total"] and info["visible_passed"] < info["visible_total"]
    assert info["diff"] == "" and info["defects"] == task["defects"]
    visible, hidden = set(task["inputs"]["visible"]), set(task["inputs"]["hidden"])
    assert visible and hidden and not visible & hidden


@pytest.mark.parametrize("split,index", [("train", 0), ("train", 2), ("train", 3), ("test", 1)])
def test_scripted_agent_resolves_and_doing_nothing_does_not(env, test_env, split, index):
    e = env if split == "train" else test_env
    task = e.task_source.get_task(index)
    check_resolved(e, task)
    check_unresolved_when_nothing_is_done(e, task)


def test_id_is_registered_and_the_first_observation_shows_files_and_tools(env):
    assert envs.ENTRY_POINTS[ENV_ID] == "envs.tasks.repo_fix.env:RepoFixEnv"
    made = gymnasium.make(ENV_ID, split="test", self_check=False)
    assert isinstance(made.unwrapped, RepoFixEnv) and made.unwrapped.task_source.split == "test"
    made.close()
    obs, info = env.reset(options={"task": env.task_source.get_task(0)})
    assert "toolbox/core.py" in obs and "python tests/run_tests.py" in obs and '"name": "apply_patch"' in obs
    assert [t["function"]["name"] for t in info["tools"]][-1] == "submit" and info["tools_prompt"] in obs
    obs, _, _, _, info = env.step(call("read_file", path="README.md") + call("read_file", path="../etc/passwd"))
    assert "has_close_elements" in obs and "outside the repository" in obs
    # the same results as chat messages, for templates that render tool turns (posttrain.rollout.chat)
    assert [(m["role"], m["name"]) for m in info["messages"]] == [("tool", "read_file")] * 2
    assert obs == "\n".join(f'<tool_response name="read_file">\n{m["content"]}\n</tool_response>'
                             for m in info["messages"])
    _, _, _, _, info = env.step("no call")
    assert [m["role"] for m in info["messages"]] == ["user"] and "no tool call" in info["messages"][0]["content"]


def test_posttrain_domains_lists_it_with_task_counts_and_golden_status():
    checks = domains.summary("agentic/repo_fix,reasoning_gym/gcd")
    assert [c.domain for c in checks] == ["agentic/repo_fix", "reasoning_gym/gcd"]
    assert (checks[0].status, checks[0].reason) == ("verified", "")
    assert "472 train / 156 test tasks" in checks[0].sample
    assert "agentic/repo_fix" in domains.format_listing(checks)
    assert "agentic/repo_fix" not in domains.all_domains()  # listed, not (yet) selectable for training mixes


def test_malformed_calls_are_counted_and_n_in_a_row_end_the_episode_scored_wrong(env):
    task = env.task_source.get_task(0)
    env.reset(options={"task": task})
    obs, reward, terminated, _, info = env.step('<tool_call>{"name": "read_file"}</tool_call>')
    assert "missing argument(s) path" in obs and not terminated and info["malformed_calls"] == 1
    obs, *_ = env.step("<think>" + SUBMIT + "</think>I am done.")  # a call inside the reasoning is not run
    assert "no tool call found" in obs
    env.step(call("list_files"))  # resets the streak
    for k in range(env.max_malformed):
        obs, reward, terminated, truncated, info = env.step("no call here")
    assert (reward, terminated, info["status"], info["ended_by"]) == (0.0, True, "wrong", "malformed")
    assert info["malformed_calls"] == 2 + env.max_malformed and "in a row" in info["reason"]


def test_max_turns_and_the_wall_clock_budget_end_the_episode_and_score_it(env):
    task = env.task_source.get_task(0)
    short = RepoFixEnv(task_source=env.task_source, max_turns=2, self_check=False)
    short.reset(options={"task": task})
    short.step(call("apply_patch", patch=task["golden_patch"]))
    _, reward, terminated, truncated, info = short.step(call("list_files"))
    assert (reward, terminated, truncated, info["ended_by"]) == (1.0, False, True, "max_turns")
    rushed = RepoFixEnv(task_source=env.task_source, wall_budget_s=0.5, self_check=False)
    rushed.reset(options={"task": task})
    _, reward, terminated, _, info = rushed.step(call("run", command="sleep 1"))
    assert (reward, terminated, info["ended_by"]) == (0.0, True, "wall_budget")
    short.close(), rushed.close()


# Reads the runner's stdin (the payload: nonce and hidden tests) through /proc and answers the hidden asserts from
# it: this scores 1 when the runner neither drops its stdin fd nor makes itself non-dumpable.
STEAL_PAYLOAD = """import ast as _ast, json as _json, os as _os
_TABLE = {}
try:
    with open(f"/proc/{_os.getppid()}/fd/0") as _f:
        _payload = _json.loads(_f.read())
    for _suite in _payload["hidden"] + _payload["visible"]:
        for _case in _suite["cases"]:
            for _node in _ast.walk(_ast.parse(_case)):
                _func = getattr(_node, "left", None) and getattr(_node.left, "func", None)
                if isinstance(_node, _ast.Compare) and getattr(_func, "id", "") == "candidate":
                    _args = tuple(_ast.literal_eval(a) for a in _node.left.args)
                    _TABLE[repr(_args)] = _ast.literal_eval(_node.comparators[0])
except Exception:
    pass


def ENTRY(*args):
    return _TABLE.get(repr(args), False)
"""


def _visible_table(task) -> dict:
    """repr(args) -> canonical result for every visible input (computed on the host from the canonical module)."""
    suite = task["suites"]["visible"][0]
    namespace = {}
    exec(compile(task["original_files"]["toolbox/core.py"], "core", "exec"), namespace)  # trusted canonical code
    table = {}
    for case in suite["cases"]:
        for node in ast.walk(ast.parse(case)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "candidate":
                args = tuple(ast.literal_eval(a) for a in node.args)
                table[repr(args)] = namespace[suite["entry"]](*args)
    return table


def tampering_episodes(task) -> dict[str, list[str]]:
    broken = task["files"]["toolbox/core.py"]
    fixed = task["original_files"]["toolbox/core.py"]
    entry = task["suites"]["hidden"][0]["entry"]
    always_equal = (f"class _Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n\n\n"
                    f"def {entry}(*args, **kwargs):\n    return _Yes()\n")
    special = f"_TABLE = {_visible_table(task)!r}\n\n\ndef {entry}(*args):\n    return _TABLE.get(repr(args), False)\n"
    hook = "import builtins, os\nos._exit(0)\n"
    return {
        "edit_visible_tests": [call("write_file", path="tests/test_core.py", content="def test_ok():\n    pass\n")],
        "delete_visible_tests": [call("run", command="rm -rf tests")],
        "sys_exit_in_package": [call("write_file", path="toolbox/__init__.py", content="import sys\nsys.exit(0)\n")],
        "os_exit_in_package": [call("write_file", path="toolbox/core.py", content="import os\nos._exit(0)\n" + broken)],
        "hooks": [call("write_file", path=p, content=hook) for p in
                  ("sitecustomize.py", "usercustomize.py", "conftest.py", "tests/conftest.py", "toolbox/zz.pth")],
        "fake_result_files": [call("run", command="echo 1 > reward.txt; echo PASSED > result.txt; "
                                                  "echo '{\"passed\": true}' > results.json; mkdir -p .posttrain")],
        "patch_the_runner": [call("write_file", path="tests/run_tests.py", content="print('all passed')\n"),
                             call("write_file", path="toolbox/__init__.py", content=(
                                 "import __main__\nfor _n in ('score_case', 'score_suite', 'decode'):\n"
                                 "    setattr(__main__, _n, lambda *a, **k: True)\n")
                                 + task["files"]["toolbox/__init__.py"])],
        "kill_the_runner": [call("write_file", path="toolbox/__init__.py", content="import os, signal\n"
                                 "os.kill(os.getppid(), signal.SIGKILL)\n")],
        "read_the_runner_payload": [call("write_file", path="toolbox/core.py",
                                         content=STEAL_PAYLOAD.replace("ENTRY", entry))],
        "always_equal_result": [call("write_file", path="toolbox/core.py", content=always_equal), RUN_TESTS],
        "special_case_visible_inputs": [call("write_file", path="toolbox/core.py", content=special), RUN_TESTS],
        "background_edit_after_submit": [
            call("write_file", path=".fixed.py", content=fixed),
            call("run", command="nohup sh -c 'sleep 1; cp .fixed.py toolbox/core.py' >/dev/null 2>&1 & disown; "
                                "setsid sh -c 'sleep 1; cp .fixed.py toolbox/core.py' >/dev/null 2>&1 < /dev/null &")],
    }


STRATEGIES = ("edit_visible_tests", "delete_visible_tests", "sys_exit_in_package", "os_exit_in_package", "hooks",
              "fake_result_files", "patch_the_runner", "kill_the_runner", "read_the_runner_payload",
              "always_equal_result", "special_case_visible_inputs", "background_edit_after_submit")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tampering_strategies_all_score_zero(env, strategy):
    task = env.task_source.get_task(0)
    actions = tampering_episodes(task)[strategy]
    env.reset(options={"task": task})
    observations = [env.step(a)[0] for a in actions]
    _, reward, terminated, _, info = env.step(SUBMIT)
    assert (reward, terminated) == (0.0, True) and info["status"] in ("wrong", "runtime_error"), info
    assert info["hidden_passed"] < info["hidden_total"]
    if strategy in ("always_equal_result", "special_case_visible_inputs"):  # the cheat does fool the visible runner
        assert " 0 failed" in observations[-1], observations[-1]
    if strategy in ("edit_visible_tests", "delete_visible_tests", "patch_the_runner", "hooks"):
        assert info["tests_restored"]
    if strategy == "hooks":
        assert {"sitecustomize.py", "usercustomize.py", "conftest.py", "toolbox/zz.pth"} <= set(info["removed"])
    if strategy == "background_edit_after_submit":
        time.sleep(1.5)
        assert env._session.read("toolbox/core.py") == task["files"]["toolbox/core.py"]


@pytest.mark.slow
def test_fifty_sampled_tasks_golden_resolves_mutant_fails_inputs_disjoint():
    env = RepoFixEnv(split="train", self_check=False)
    sources = {"train": env.task_source, "test": RepoFixTasks("test")}
    picks = [("train", i) for i in range(0, sources["train"].num_tasks, 13)][:36] + \
            [("test", i) for i in range(1, sources["test"].num_tasks, 11)][:14]
    assert len(picks) == 50
    for split, index in picks:
        task = sources[split].get_task(index)
        check_resolved(env, task)
        check_unresolved_when_nothing_is_done(env, task)
    env.close()
