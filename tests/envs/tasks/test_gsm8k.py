"""Tests for envs/tasks/gsm8k.py (GSM8K-v0) on local JSONL files."""
import json
import os
import pathlib
import re
import sys

import pytest

from envs.tasks.gsm8k import GSM8KEnv, load_gsm8k

ROWS = [
    {"question": "Janet has 16 eggs, eats 3, bakes 4 and sells the rest at $2. How much?",
     "answer": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18"},
    {"question": "A factory makes 1234 widgets a day for 1000 days. How many?",
     "answer": "1234 * 1000 = 1234000\n#### 1,234,000"},
]
SHARED = "/work/shared/data/gsm8k/test.jsonl"


@pytest.fixture
def data_dir(tmp_path):
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
    return tmp_path


def test_loads_file_or_directory(data_dir):
    rows = load_gsm8k("test", str(data_dir))
    assert [r["question"] for r in rows] == [r["question"] for r in ROWS]
    assert rows[1]["id"] == "gsm8k-test-1"
    assert load_gsm8k("train", str(data_dir / "train.jsonl")) == [{**r, "id": r["id"].replace("test", "train")}
                                                                   for r in rows]


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k("test", str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="split"):
        load_gsm8k("validation", str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_gsm8k("test", str(bad))


def test_without_path_and_without_loaders_the_error_says_what_was_tried(monkeypatch):
    """No path and neither optional loader importable: one FileNotFoundError naming each loader tried and why it
    failed, and how to pass a path. (The loaders' imports are made to fail; importing TFDS alone takes ~20 s.)"""
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FileNotFoundError) as err:
        load_gsm8k("train")  # the test split is shipped; the train split needs a path or a loader
    msg = str(err.value)
    assert re.search(r"tfds: ModuleNotFoundError: .*tensorflow_datasets", msg), msg
    assert re.search(r"hf datasets: ModuleNotFoundError: .*datasets", msg), msg
    assert "path=" in msg and "split 'train'" in msg


def test_the_test_split_is_shipped_and_equals_the_published_file(monkeypatch):
    """A fresh clone evaluates GSM8K: the packaged test split has the 1,319 problems, row for row those of the
    published test.jsonl where that file is present (../shared/data/gsm8k, the developers' copy)."""
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    rows = load_gsm8k("test")
    assert len(rows) == 1319 and rows[0]["id"] == "gsm8k-test-0" and "####" in rows[0]["answer"]
    published = pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k"
    if published.is_dir():
        assert rows == load_gsm8k("test", str(published))
    env = GSM8KEnv(split="test", max_examples=3)
    assert env.task_source.num_tasks == 3


@pytest.mark.parametrize("reply,reward", [
    ("9 eggs, 9*2 = 18 dollars.\n#### 18", 1.0), ("The answer is \\boxed{18}.", 1.0),
    ("#### $18.00", 1.0), ("#### 19", 0.0), ("I don't know", 0.0), ("", 0.0)])
def test_rewards(data_dir, reply, reward):
    env = GSM8KEnv(path=str(data_dir))
    obs, _ = env.reset(options={"task": env.task_source.get_task(0)})
    assert obs.startswith(ROWS[0]["question"]) and "####" in obs
    _, r, terminated, truncated, info = env.step(reply)
    assert (r, terminated, truncated) == (reward, True, False)
    assert info["gold"] == "18" and info["status"] == ("ok" if reward else "wrong")


def test_thousands_separator_gold(data_dir):
    env = GSM8KEnv(path=str(data_dir))
    env.reset(options={"task": env.task_source.get_task(1)})
    assert env.step("1234 * 1000 = 1234000\n#### 1234000")[1] == 1.0


def test_max_examples_and_bad_task(data_dir):
    env = GSM8KEnv(path=str(data_dir), max_examples=1)
    assert env.task_source.num_tasks == 1
    with pytest.raises(ValueError, match="question"):
        env.reset(options={"task": {"answer": "#### 1"}})


@pytest.mark.skipif(not os.path.exists(SHARED), reason="shared GSM8K copy not present on this machine")
def test_real_test_split_self_checks_and_every_reference_solution_scores_one():
    env = GSM8KEnv(path=SHARED)
    assert env.task_source.num_tasks == 1319
    for i in range(0, 1319, 50):
        env.reset(options={"task": env.task_source.get_task(i)})
        assert env.step(env.task["answer"])[1] == 1.0


def test_reasoning_trace_is_skipped_per_env(data_dir):
    class NoTrace(GSM8KEnv):
        think_tags = None

    reply = "<think>maybe 17, maybe #### 18</think>#### 17"
    for env_cls, reward in ((GSM8KEnv, 0.0), (NoTrace, 0.0)):
        env = env_cls(path=str(data_dir))
        env.reset(options={"task": env.task_source.get_task(0)})
        assert env.step(reply)[1] == reward
    env = NoTrace(path=str(data_dir))
    env.reset(options={"task": env.task_source.get_task(0)})
    assert env.step("<think>#### 18</think>")[1] == 1.0  # read whole: the trace's #### counts
    env = GSM8KEnv(path=str(data_dir))
    env.reset(options={"task": env.task_source.get_task(0)})
    _, reward, _, _, info = env.step("<think>#### 18</think>")
    assert reward == 0.0 and info["reason"] == "no reply after the reasoning trace"
