"""TaskFile-v0: JSONL / CSV / Parquet rows as tasks, malformed rows named by file and line, the split rule, field
mapping, chat prompts, and GSM8K read as a task file scoring as GSM8K-v0."""
import csv
import json
import pathlib

import gymnasium
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import envs  # noqa: F401  (registers the ids)
from envs.tasks import gsm8k, task_file

GSM8K_DIR = pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k"
ROWS = [{"id": f"q{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def make(path, **kwargs):
    return gymnasium.make(task_file.ENV_ID, path=path, **kwargs).unwrapped


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_every_format_gives_the_same_tasks_and_rewards(tmp_path, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    elif fmt == "csv":
        path = write_csv(tmp_path / "t.csv", ROWS)
    else:
        path = str(tmp_path / "t.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    env = make(path, split="all", verifier="numeric")
    assert env.task_source.num_tasks == 20
    task = env.task_source.get_task(3)
    assert task["id"] == "q3" and env.first_observation(task) == "What is 3 + 3?"
    assert env.score(task, "<answer>6</answer>")[0] == 1.0
    assert env.score(task, "The answer is 7")[0] == 0.0


def test_splits_come_from_the_column_or_a_stable_hash_of_the_id(tmp_path):
    rows = [dict(r, split="test" if i < 3 else "train") for i, r in enumerate(ROWS)]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    assert [t["id"] for t in task_file.load_tasks(task_file.TaskFileSettings(path=path, split="test"))] == \
        ["q0", "q1", "q2"]
    many = [{"id": f"r{i}", "prompt": "p", "answer": "a"} for i in range(2000)]
    path = write_jsonl(tmp_path / "h.jsonl", many)
    test = {t["id"] for t in task_file.load_tasks(task_file.TaskFileSettings(path=path, split="test"))}
    assert 120 < len(test) < 280  # test_fraction 0.1 of 2000
    shuffled = write_jsonl(tmp_path / "h2.jsonl", list(reversed(many)) + [{"id": "new", "prompt": "p", "answer": "a"}])
    test2 = {t["id"] for t in task_file.load_tasks(task_file.TaskFileSettings(path=shuffled, split="test"))}
    assert test <= test2 and len(test2 - test) <= 1  # reordering and adding rows moves no row between splits


@pytest.mark.parametrize("line,problem", [
    ("{not json", "not JSON"),
    ('"a string"', "must be an object"),
    ('{"answer": "1"}', "no prompt"),
    ('{"prompt": "  ", "answer": "1"}', "prompt is empty"),
    ('{"prompt": "q"}', "answer"),
    ('{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}', "last prompt message"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', "prompt message 0"),
    ('{"prompt": "q", "answer": "1", "split": "dev"}', "split must be"),
    ('{"prompt": "q", "answer": "1", "verifier": "nonsense"}', "nonsense"),
    ('{"id": "q1", "prompt": "q", "answer": "1"}', "repeats the row"),
])
def test_malformed_rows_are_refused_with_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[1]) + "\n\n" + line + "\n")
    with pytest.raises(task_file.TaskFileError) as e:
        make(str(path))
    assert f"{path}:3: " in str(e.value) and problem in str(e.value), str(e.value)


def test_every_malformed_row_is_counted_and_the_first_named(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("prompt,answer\nq,1\n,2\nq3,\n\"q4\",4,extra\n")
    with pytest.raises(task_file.TaskFileError, match=r"3 malformed row\(s\): .*bad.csv:3: prompt is empty"):
        make(str(path))


def test_missing_file_unknown_format_and_bad_settings_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        make(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        make(str(tmp_path / "x.txt"))
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(ValueError, match="keys:"):
        make(path, answr_after="####")
    with pytest.raises(ValueError, match="template"):
        make(path, template="no field")
    with pytest.raises(task_file.TaskFileError, match="no 'test' rows"):
        make(path, split="test", test_fraction=0.0)


def test_field_mapping_answer_marker_template_and_system_prompt(tmp_path):
    rows = [{"q": f"Tom has {i} apples.", "sol": f"He has {i}.\n#### {i}", "topic": "fruit"} for i in range(5)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    env = make(path, split="all", fields={"prompt": "q", "answer": "sol"}, answer_after="####",
               template="[{topic}] {prompt} Answer with a number.", system_prompt="Be brief.", verifier="math")
    obs, info = env.reset(options={"task": env.task_source.get_task(2)})
    assert obs == "[fruit] Tom has 2 apples. Answer with a number." and info["system_prompt"] == "Be brief."
    assert env.task_source.get_task(2)["answer"] == "2"
    assert env.step("#### 2")[1] == 1.0
    with pytest.raises(task_file.TaskFileError, match="no column"):
        make(path, fields={"prompt": "question"})
    with pytest.raises(task_file.TaskFileError, match="template names"):
        make(path, fields={"prompt": "q", "answer": "sol"}, template="{prompt} {nope}")


def test_chat_message_prompts_keep_their_system_and_history(tmp_path):
    row = {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}], "answer": "6"}
    env = make(write_jsonl(tmp_path / "c.jsonl", [row, dict(row, answer="6")]), split="all")
    obs, info = env.reset(options={"task": env.task_source.get_task(0)})
    assert obs == "3+3?" and info["system_prompt"] == "You are terse."
    assert info["prompt_messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_rows_carry_their_own_verifiers(tmp_path):
    rows = [{"prompt": "Pick", "answer": "B", "verifier": "choice", "choices": ["x", "y", "z"]},
            {"prompt": "Pi?", "answer": "3.14159", "verifier": {"name": "numeric", "tolerance": 0.01}},
            {"prompt": "Name", "answer": "Ada"}]
    env = make(write_jsonl(tmp_path / "v.jsonl", rows), split="all")
    t0, t1, t2 = (env.task_source.get_task(i) for i in range(3))
    assert env.score(t0, "<answer>B</answer>")[0] == 1.0 and env.score(t0, "<answer>A or B</answer>")[0] == 0.0
    assert env.score(t1, "<answer>3.14</answer>")[0] == 1.0
    assert env.score(t2, "<answer>ada</answer>")[0] == 1.0  # the file's default: exact, case-insensitive


def test_golden_failures_name_the_rows_whose_answer_cannot_pass(tmp_path):
    rows = ROWS[:4] + [{"id": "bad", "prompt": "x", "answer": "not a number"}]
    tasks, errors = task_file.scan(task_file.TaskFileSettings(path=write_jsonl(tmp_path / "g.jsonl", rows),
                                                              split="all", verifier="numeric"))
    assert not errors or all("bad" in w or "g.jsonl:5" in w for w, _ in errors)
    failing = [i for i, *_ in task_file.golden_failures(tasks)] + [w for w, _ in errors]
    assert failing and all("bad" in x or "g.jsonl:5" in x for x in failing)


def test_a_config_entry_with_a_path_is_the_task_file_env(tmp_path):
    from posttrain.config.load import ConfigError, convert_section
    from posttrain.rollout.env_side import EnvSpec

    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    spec = convert_section(EnvSpec, {"path": path, "kwargs": {"verifier": "numeric"}}, "env.train.mine")
    assert spec.id == task_file.ENV_ID and spec.kwargs == {"verifier": "numeric", "path": path}
    with pytest.raises(ConfigError, match="env.train.mine.path"):
        convert_section(EnvSpec, {"path": path, "id": "posttrain/Arithmetic-v0"}, "env.train.mine")
    with pytest.raises(ConfigError, match="env.train.mine.id"):
        convert_section(EnvSpec, {}, "env.train.mine")


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="GSM8K test data (../shared/data/gsm8k) absent")
def test_gsm8k_as_a_task_file_scores_as_gsm8k_v0_on_200_replies():
    path = str(GSM8K_DIR / "test.jsonl")
    builtin = gsm8k.GSM8KEnv(split="test", path=str(GSM8K_DIR), max_examples=40)
    ours = make(path, split="all", max_rows=40, fields={"prompt": "question"}, answer_after="####",
                verifier="math", template="{prompt}" + gsm8k.INSTRUCTION)
    replies = []
    for i in range(40):
        gold = builtin.task_source.get_task(i)["answer"].rsplit("####", 1)[1].strip()
        replies += [(i, f"Steps...\n#### {gold}"), (i, f"So it is \\boxed{{{gold}}}."), (i, f"#### {gold}0"),
                    (i, f"The answer is {gold.replace('0', '٠')}"), (i, "I do not know")]
    rewards_builtin, rewards_ours = [], []
    for i, reply in replies:
        task_b, task_o = builtin.task_source.get_task(i), ours.task_source.get_task(i)
        assert builtin.first_observation(builtin.validate_task(dict(task_b))) == ours.first_observation(task_o)
        rewards_builtin.append(builtin.play(task_b, [reply])[0])
        rewards_ours.append(ours.score(task_o, reply)[0])
    assert len(replies) == 200 and rewards_ours == rewards_builtin
    assert 0.3 < sum(rewards_ours) / 200 < 0.8  # both kinds present


def test_code_rows_run_their_tests_in_the_sandbox(tmp_path):
    row = {"prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
           "entry_point": "add", "verifier": "code_tests"}
    env = make(write_jsonl(tmp_path / "code.jsonl", [row, dict(row, id="second")]), split="all")
    task = env.task_source.get_task(0)
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    assert env.score(task, good)[0] == 1.0
    reward, info = env.score(task, "```python\ndef add(a, b):\n    return a - b\n```")
    assert reward == 0.0 and info["status"] == "wrong"
    assert env.score(task, "```python\nimport sys\nsys.exit(0)\n```")[0] == 0.0


def test_rows_are_named_by_their_first_line_and_every_text_form_reads(tmp_path):
    """A CSV record with quoted newlines is named by its first line; JSONL with a byte-order mark and a .json file
    holding an array read as rows; a non-UTF-8 byte is named with its line."""
    path = tmp_path / "multi.csv"
    path.write_text('prompt,answer\n"line one\nline two\nline three",1\n,2\n')
    with pytest.raises(task_file.TaskFileError, match=r"multi.csv:5: prompt is empty"):
        make(str(path))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n" + json.dumps(ROWS[1]).encode() + b"\n")
    assert make(str(bom), split="all").task_source.num_tasks == 2
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(ROWS[:5]))
    assert make(str(array), split="all").task_source.num_tasks == 5
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,answer\nq1,1\ncaf\xe9?,2\n")
    with pytest.raises(task_file.TaskFileError, match=r"latin.csv:3: not UTF-8 text"):
        make(str(latin))


def test_a_choice_index_written_as_text_is_an_index(tmp_path):
    rows = [{"prompt": "Pick", "answer": "2", "choices": json.dumps(["x", "y", "z"]), "verifier": "choice"},
            {"prompt": "Pick", "answer": "1", "choices": json.dumps(["1", "2", "3"]), "verifier": "choice"}]
    env = make(write_csv(tmp_path / "c.csv", rows), split="all")
    index, text = env.task_source.get_task(0), env.task_source.get_task(1)
    assert env.score(index, "<answer>C</answer>")[0] == 1.0  # index 2
    assert env.score(text, "<answer>A</answer>")[0] == 1.0  # a choice's text "1" wins over index 1 (B)


def test_an_evaluation_reads_an_unsplit_file_whole_and_a_split_one_as_training_does(tmp_path):
    unsplit = write_jsonl(tmp_path / "u.jsonl", ROWS)
    assert make(unsplit, split="test", unsplit="test").task_source.num_tasks == 20
    partly = [dict(r, split="train") if i < 3 else r for i, r in enumerate(ROWS)]
    path = write_jsonl(tmp_path / "p.jsonl", partly)
    as_training = {t["id"] for t in task_file.load_tasks(task_file.TaskFileSettings(path=path, split="test"))}
    as_suite = {t["id"] for t in task_file.load_tasks(task_file.TaskFileSettings(path=path, split="test",
                                                                                 unsplit="test"))}
    assert as_suite == as_training  # blank split cells follow the hash rule both times: no trained row evaluated
    with pytest.raises(ValueError, match="unsplit"):
        make(unsplit, unsplit="all")
