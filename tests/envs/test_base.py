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


class RewardEnv(base.TextEnv):
    """A one-turn TextEnv whose turn_step returns the task's "reward" as is (the user-written reward under test)."""

    def __init__(self):
        super().__init__(base.ListTaskSource([{"id": "t", "reward": 1.0}], split="test"), self_check=False)

    def first_observation(self, task):
        return "q"

    def turn_step(self, action):
        return "", self.task["reward"], True, {"status": "ok"}


# kind: what may pass for a reward: real numbers become floats (bools as 0/1), anything else is never coerced
@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), (__import__("numpy").float32(0.5), 0.5),
    (__import__("numpy").int64(-3), -3.0), (__import__("numpy").bool_(True), 1.0),
    (__import__("fractions").Fraction(1, 4), 0.25), (float("nan"), "nan"), (float("-inf"), float("-inf")),
    ("1.0", None), ("", None), (b"1", None), (None, None), (1 + 0j, None), ([1.0], None), ((1.0,), None),
    (__import__("numpy").array(1.0), None), (__import__("numpy").complex64(1), None), ({"r": 1}, None),
])
def test_as_reward_takes_real_numbers_only(value, expected):
    got = base.as_reward(value)
    if expected == "nan":
        assert got != got and type(got) is float
    else:
        assert got == expected and (expected is None or type(got) is float)


@pytest.mark.parametrize("reward", ["1.0", None, [1.0], 1 + 0j])
def test_step_returns_a_reward_that_is_no_real_number_unchanged(reward):
    """TextEnv.step used to float() the reward: "1.0" scored 1. It now returns it as turn_step did, for the caller
    to refuse (posttrain's rollout: an infra_error naming the env)."""
    env = RewardEnv()
    env.reset(options={"task": {"id": "t", "reward": reward}})
    _, got, terminated, truncated, info = env.step("x")
    assert got is reward and terminated and not truncated and info["status"] == "ok"


@pytest.mark.parametrize("reward, expected", [(True, 1.0), (__import__("numpy").float64(0.5), 0.5), (2, 2.0)])
def test_step_gives_a_real_reward_as_a_float(reward, expected):
    env = RewardEnv()
    env.reset(options={"task": {"id": "t", "reward": reward}})
    got = env.step("x")[1]
    assert got == expected and type(got) is float


def test_self_check_names_a_reward_of_the_wrong_type():
    class StringReward(EchoEnv):
        def turn_step(self, action):
            obs, reward, done, info = super().turn_step(action)
            return obs, str(reward), done, info

    with pytest.raises(RuntimeError, match=r"expected reward 1.0, got '1.0'"):
        StringReward()
