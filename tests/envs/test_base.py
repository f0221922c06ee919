"""Tests for envs/base.py: the TextEnv contract, task sources, the self-check (invariant 7)."""
import pytest

from envs import base


class EchoEnv(base.QuestionAnswerEnv):
    """A QuestionAnswerEnv whose golden answer can be broken on purpose."""

    def __init__(self, golden="right", max_turns=1, self_check=True):
        self.golden = golden
        tasks = base.ListTaskSource([{"id": "t0", "question": "1+1?", "answer": "2"},
                                     {"id": "t1", "question": "2+2?", "answer": "4"}], split="test")
        super().__init__(tasks, max_turns=max_turns, self_check=self_check)

    def golden_answer(self, task):
        return "#### 2" if self.golden == "right" else "#### 3"


def test_spaces_hold_any_text():
    env = EchoEnv()
    assert env.observation_space.contains("What is 59 + 63? ’é\n")
    assert not env.observation_space.contains(b"bytes")
    assert env.action_space.contains("")


def test_self_check_catches_a_broken_verifier():
    with pytest.raises(RuntimeError, match="self-check failed"):
        EchoEnv(golden="wrong")


def test_reset_draws_from_the_source_with_the_seed():
    env = EchoEnv()
    draws = [env.reset(seed=s)[1]["task_id"] for s in range(20)]
    assert set(draws) == {"t0", "t1"}
    assert draws == [env.reset(seed=s)[1]["task_id"] for s in range(20)]


def test_step_contract_errors():
    env = EchoEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("2")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="str"):
        env.step(2)
    env.step("2")
    with pytest.raises(RuntimeError, match="outside an episode"):
        env.step("2")
    with pytest.raises(TypeError, match="dict"):
        env.reset(options={"task": "1+1?"})


def test_list_task_source():
    source = base.ListTaskSource([{"a": 1}], split="train")
    task = source.get_task(0)
    task["a"] = 2
    assert source.get_task(0) == {"a": 1} and source.num_tasks == 1
    assert isinstance(source, base.TaskSource)
    with pytest.raises(IndexError, match="outside"):
        source.get_task(1)
    with pytest.raises(ValueError, match="empty"):
        base.ListTaskSource([], split="train")


def test_constructor_validation_and_helpers():
    with pytest.raises(ValueError, match="max_turns"):
        EchoEnv(max_turns=0)
    with pytest.raises(TypeError, match="TaskSource"):
        base.QuestionAnswerEnv([{"question": "q", "answer": "1"}])
    assert base.cap_text("abcdefgh", 4) == "ab\n... [4 characters truncated] ...\ngh"
    assert base.cap_text("abc", 3) == "abc"
    assert base.wrong_answer("18") == "19" and base.wrong_answer("E") == "not-E"
