"""Tests for envs/arithmetic.py (the quickstart's default task)."""
import re

import pytest

from envs.tasks import arithmetic
from envs.tasks.arithmetic import ArithmeticEnv, ArithmeticTasks


def _operands(tasks):
    return {tuple(tasks.get_task(i)["operands"]) for i in range(tasks.num_tasks)}


def test_default_prompt_and_operand_range():
    tasks = ArithmeticTasks("train")
    for i in range(0, tasks.num_tasks, 97):
        task = tasks.get_task(i)
        a, b = task["operands"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert task["question"] == f"What is {a} + {b}? Answer with just the number."
        assert task["answer"] == str(a + b)


def test_splits_are_disjoint_and_cover_the_space():
    train, test = ArithmeticTasks("train"), ArithmeticTasks("test")
    assert test.num_tasks == 200 and train.num_tasks == 90 * 90 - 200
    train_set, test_set = _operands(train), _operands(test)
    assert len(train_set) == train.num_tasks and len(test_set) == 200
    assert not train_set & test_set
    assert len(train_set | test_set) == 90 * 90


def test_test_split_does_not_depend_on_train_seed_and_train_order_does():
    assert _operands(ArithmeticTasks("test", seed=0)) == _operands(ArithmeticTasks("test", seed=7))
    a, b = ArithmeticTasks("train", seed=0), ArithmeticTasks("train", seed=7)
    assert [a.get_task(i) for i in range(20)] != [b.get_task(i) for i in range(20)]
    assert a.get_task(5) == ArithmeticTasks("train", seed=0).get_task(5)  # deterministic


def test_permute_is_a_bijection():
    for n in (1, 2, 7, 100, 1000):
        assert sorted(arithmetic.permute(i, n, key=3) for i in range(n)) == list(range(n))
    with pytest.raises(ValueError):
        arithmetic.permute(5, 5, key=0)


def test_other_ops_and_digits_and_huge_spaces():
    tasks = ArithmeticTasks("train", digits=12, ops=("*", "-"))
    task = tasks.get_task(tasks.num_tasks - 1)
    a, b = task["operands"]
    assert 10**11 <= a < 10**12 and int(task["answer"]) == (a * b if task["op"] == "*" else a - b)
    one_digit = _operands(ArithmeticTasks("train", digits=1, num_test=10))
    assert all(0 <= a <= 9 for a, _ in one_digit) and len(one_digit) == 90


@pytest.mark.parametrize("kwargs,match", [
    ({"split": "val"}, "split"), ({"digits": 0}, "digits"), ({"ops": ("/",)}, "ops"),
    ({"ops": ()}, "ops"), ({"num_test": 5000}, "num_test"), ({"prompt": "What is {x}?"}, "template")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTasks(**kwargs)


def test_index_errors():
    tasks = ArithmeticTasks("test")
    with pytest.raises(IndexError):
        tasks.get_task(200)
    with pytest.raises(TypeError):
        tasks.get_task(1.0)


def test_env_rewards():
    env = ArithmeticEnv()
    obs, info = env.reset(options={"task": {"question": "What is 59 + 63? Answer with just the number.",
                                            "answer": "122"}})
    assert obs == "What is 59 + 63? Answer with just the number."
    _, reward, terminated, truncated, info = env.step("The answer is 122.")
    assert (reward, terminated, truncated, info["status"]) == (1.0, True, False, "ok")
    env.reset(seed=1)
    gold = env.task["gold"]
    _, reward, *_, info = env.step(str(int(gold) + 1))
    assert reward == 0.0 and info["status"] == "wrong" and info["gold"] == gold


def test_seeded_reset_is_reproducible():
    env = ArithmeticEnv(split="test")
    first = [env.reset(seed=s)[0] for s in range(5)]
    assert first == [env.reset(seed=s)[0] for s in range(5)]
    assert all(re.fullmatch(r"What is \d\d \+ \d\d\? Answer with just the number\.", o) for o in first)
