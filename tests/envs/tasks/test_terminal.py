"""Tests for envs/terminal.py (Terminal-v0): persistent workspace, DONE protocol, host-side checkers."""
import pytest

from envs.tasks import terminal
from envs.tasks.terminal import GOLDEN_COMMANDS, TerminalEnv


@pytest.fixture(scope="module")
def env():
    env = TerminalEnv(max_turns=4)
    yield env
    env.close()


def _bash(cmd):
    return f"```bash\n{cmd}\n```"


@pytest.mark.parametrize("task_id", sorted(GOLDEN_COMMANDS))
def test_every_builtin_task_is_solvable_and_not_solved_by_doing_nothing(env, task_id):
    obs, _ = env.reset(options={"task": {"id": task_id}})
    assert "DONE" in obs
    _, reward, terminated, _, info = env.step(_bash(GOLDEN_COMMANDS[task_id]) + "\nDONE")
    assert (reward, terminated, info["status"]) == (1.0, True, "ok"), info
    env.reset(options={"task": {"id": task_id}})
    _, reward, terminated, _, info = env.step("DONE")
    assert (reward, terminated, info["status"]) == (0.0, True, "wrong") and info["reason"]


def test_workspace_persists_across_turns_and_output_comes_back(env):
    env.reset(options={"task": {"id": "hello-file"}})
    obs, reward, terminated, *_ = env.step(_bash("echo 'Hello, posttrain!' > tmp.txt; ls"))
    assert "tmp.txt" in obs and "[exit code 0]" in obs and not terminated
    obs, *_ = env.step(_bash("mv tmp.txt hello.txt && cat hello.txt; exit 3"))
    assert "Hello, posttrain!" in obs and "[exit code 3]" in obs
    _, reward, terminated, *_ = env.step("All set.\nDONE\n")
    assert reward == 1.0 and terminated


def test_workspace_is_fresh_for_each_episode(env):
    env.reset(options={"task": {"id": "hello-file"}})
    env.step(_bash("echo 'Hello, posttrain!' > hello.txt"))
    env.reset(options={"task": {"id": "hello-file"}})
    assert env.step("DONE")[1] == 0.0


def test_fake_result_files_and_shallow_fixes_gain_nothing(env):
    env.reset(options={"task": {"id": "fix-script"}})
    _, reward, *_ = env.step(_bash("echo 1 > reward.txt; echo PASSED > result.txt; echo '{\"reward\": 1}' > "
                                   "result.json") + "\nDONE")
    assert reward == 0.0
    env.reset(options={"task": {"id": "fix-script"}})
    _, reward, _, _, info = env.step(_bash("echo 'print(6)' > run.py") + "\nDONE")
    assert reward == 0.0 and "hidden" in info["reason"]
    env.reset(options={"task": {"id": "count-errors"}})
    _, reward, *_ = env.step(_bash("echo ERROR > log.txt; grep -c ERROR log.txt > out.txt") + "\nDONE")
    assert reward == 0.0  # the expected count lives on the host, not in log.txt


def test_protocol_details(env):
    env.reset(options={"task": {"id": "hello-file"}})
    obs, reward, terminated, truncated, _ = env.step("I will think about it.")
    assert obs == terminal.REMINDER and not terminated and not truncated
    obs, _, terminated, *_ = env.step(_bash("echo DONE"))  # DONE inside a block is not the signal
    assert not terminated and "DONE" in obs
    _, reward, terminated, truncated, info = env.step(_bash("echo 'Hello, posttrain!' > hello.txt"))
    _, reward, terminated, truncated, info = env.step(_bash("true"))
    assert (terminated, truncated, reward) == (False, True, 1.0) and "max_turns" in info["reason"]


def test_task_validation():
    env = TerminalEnv(self_check=False)
    with pytest.raises(ValueError, match="unknown built-in"):
        env.reset(options={"task": {"id": "nope"}})
    with pytest.raises(ValueError, match="check"):
        env.reset(options={"task": {"id": "x", "instruction": "i", "files": {}}})
    env.close()


# turn -> (episode ended, hello.txt written): commands and DONE inside a reasoning trace are not acted on
@pytest.mark.parametrize("turn,think_tags,ended,wrote", [
    ("<think>maybe\n" + _bash("echo 'Hello, posttrain!' > hello.txt") + "\nDONE\n</think>ok", TerminalEnv.think_tags,
     False, False),
    ("<think>\nDONE\n</think>\n" + _bash("echo 'Hello, posttrain!' > hello.txt"), TerminalEnv.think_tags, False, True),
    ("<think>" + _bash("rm -f x") + "</think>" + _bash("echo 'Hello, posttrain!' > hello.txt") + "\nDONE",
     TerminalEnv.think_tags, True, True),
    ("<think>cut off " + _bash("echo 'Hello, posttrain!' > hello.txt") + "\nDONE\n", TerminalEnv.think_tags, False,
     False),
    ("<think>\nDONE\n</think>\n" + _bash("echo 'Hello, posttrain!' > hello.txt"), None, True, True),  # turned off
])
def test_commands_and_done_are_read_after_the_reasoning_trace(turn, think_tags, ended, wrote):
    env = TerminalEnv(max_turns=4, self_check=False)
    env.think_tags = think_tags
    try:
        env.reset(options={"task": {"id": "hello-file"}})
        _, reward, terminated, *_ = env.step(turn)
        assert terminated == ended and reward == (1.0 if ended and wrote else 0.0)
        if not ended:  # a second turn ends it: the checker says whether the first turn wrote the file
            assert env.step("DONE")[1] == (1.0 if wrote else 0.0)
    finally:
        env.close()
