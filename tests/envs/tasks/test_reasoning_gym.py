"""ReasoningGym-v0: extraction after the reasoning block, the dataset's own scorer, splits, levels, errors."""
import subprocess
import sys

import gymnasium
import pytest

import envs  # noqa: F401
from envs.tasks import reasoning_gym
def make(dataset="chain_sum", **kw):
    return reasoning_gym.ReasoningGymEnv(dataset=dataset, size=kw.pop("size", 16), num_test=kw.pop("num_test", 8), **kw)


def test_gymnasium_make_and_episode_scores_reference_one():
    env = gymnasium.make(reasoning_gym.ENV_ID, dataset="chain_sum", size=16, num_test=4).unwrapped
    obs, info = env.reset(seed=3)
    assert "<answer>" in obs and obs.startswith(env.task["question"])
    gold = env.task["answer"]
    _, reward, terminated, truncated, info = env.step(f"<think>maybe <answer>-1</answer></think>\n<answer>{gold}</answer>")
    assert (reward, terminated, truncated, info["status"], info["extracted"]) == (1.0, True, False, "ok", gold)


def test_answer_inside_think_block_is_not_read():
    env = make()
    env.reset(options={"task": env.task_source.get_task(0)})
    gold = env.task["answer"]
    _, reward, _, _, info = env.step(f"<think><answer>{gold}</answer></think> I give up.")
    assert reward < 1.0 and info["extracted"] is None and "no <answer>" in info["reason"]


# Reply forms -> extracted answer (`envs.verify.tagged.read_answer`): {g} is the task's gold answer, {w} a wrong one. The forms are
# what SmolLM2-135M-Instruct writes for these prompts (it never writes the tags); the second half must not score.
REPLY_FORMS = [
    ("<answer>{g}</answer>", "{g}", "answer_tag", 1.0),
    ("<think>maybe {w}</think>\nSo <answer> {g} </answer>.", "{g}", "answer_tag", 1.0),
    ("The answer is {g}.", "{g}", "fallback_phrase", 1.0),
    ("The final answer to this arithmetic problem is {g}.", "{g}", "fallback_phrase", 1.0),
    ("Here is how to count them:\n\nThe answer is: {g}", "{g}", "fallback_phrase", 1.0),
    ("Let me think.\n**Answer:** `{g}`", "{g}", "fallback_phrase", 1.0),
    ("The answer is {w} + 0 = {g}.", "{g}", "fallback_phrase", 1.0),
    ("{w} - {w} + {g} = {g}", "{g}", "fallback_equation", 1.0),
    ("The greatest common divisor of the two numbers is {g}.", "{g}", "fallback_is", 1.0),
    ("Step 1: something.\n\n$\\boxed{{{g}}}$", "{g}", "fallback_boxed", 1.0),
    ("{g}", "{g}", "fallback_bare", 1.0),
    # must not score
    ("", None, "none", 0.0),
    ("   \n\n ", None, "none", 0.0),
    ("I first get {g}.\nNo, I made a mistake: the answer is {w}.", "{w}", "fallback_phrase", 0.0),
    ("The answer is {g}.\nWait, recheck: {g} + 1 = {w}", "{w}", "fallback_equation", 0.0),
    ("<answer>{w}</answer> Actually the answer is {g}.", "{w}", "answer_tag", 0.0),
    ("The answer is {g}.\n<answer>{w}</answer>", "{w}", "answer_tag", 0.0),
    ("<think>The answer is {g}.</think>", None, "none", 0.0),
    ("The answer is {g}. <answer>", None, "none", 0.0),
    ("<answer></answer>\nThe answer is {g}.", "", "answer_tag", 0.0),
    ("The sum is {g} and the product is {w}.\nI am not sure which one.", None, "none", 0.0),
    ("{g} = {w} + 1 and so on", None, "none", 0.0),
    ("The question asks for the result, which is a multiplication of {g} terms.", None, "none", 0.0),
    ("The letter appears {g} times in the text.", None, "none", 0.0),
    ("The answer is \\boxed{{{g}", None, "none", 0.0),
]


@pytest.mark.parametrize("reply,extracted,method,reward", REPLY_FORMS)
def test_reply_forms_table(reply, extracted, method, reward):
    env = make("gcd")
    task = env.task_source.get_task(0)
    gold, wrong = task["answer"], str(int(task["answer"]) + 7)
    reply = reply.format(g=gold, w=wrong)
    got, info = env.score(task, reply)
    assert (info["extracted"], info["method"], got) == (
        None if extracted is None else extracted.format(g=gold, w=wrong), method, reward)
    assert (got == 1.0) == (info["status"] == "ok")


def test_instruction_kwarg_sets_the_prompt_suffix():
    env = make("gcd", instruction=reasoning_gym.SHORT_INSTRUCTION)
    obs, _ = env.reset(options={"task": env.task_source.get_task(0)})
    assert obs == env.task["question"] + reasoning_gym.SHORT_INSTRUCTION and "<answer>" in obs
    assert make("gcd").instruction == reasoning_gym.INSTRUCTION
    with pytest.raises(ValueError, match="instruction must be a str"):
        make("gcd", instruction=3)


def test_fallback_off_reads_tags_only():
    env = make("gcd", fallback=False)
    task = env.task_source.get_task(0)
    assert env.score(task, f"The answer is {task['answer']}.")[0] == 0.0
    assert env.score(task, f"<answer>{task['answer']}</answer>")[0] == 1.0


def test_multiline_answer_survives_extraction():
    env = make("rotate_matrix")
    task = env.task_source.get_task(0)
    assert "\n" in task["answer"]
    reward, info = env.score(task, f"<answer>\n{task['answer']}\n</answer>")
    assert reward == 1.0 and info["extracted"] == task["answer"]


def test_partial_credit_is_kept_in_reward_and_info():
    env = make("gcd")  # the library's default scorer: len(gold) / len(answer) when the answer contains gold
    task = env.task_source.get_task(0)
    reward, info = env.score(task, f"<answer>{task['answer']}!!</answer>")
    assert 0.0 < reward < 1.0 and info["score"] == reward and info["status"] == "wrong"
    reward, info = env.score(task, f"<answer>{task['answer']} extra words</answer>")  # more than the answer
    assert reward == 0.0 and info["score"] == 0.0 and info["status"] == "wrong"


def test_scorer_exception_scores_zero_with_reason():
    env = make("prime_factorization")
    task = env.task_source.get_task(0)
    reward, info = env.score(task, "<answer>not a number</answer>")
    assert reward == 0.0 and info["reason"].startswith("scorer error")


def test_splits_differ_and_are_deterministic():
    train, test = make(split="train"), make(split="test")
    a = [train.task_source.get_task(i)["question"] for i in range(8)]
    assert a == [make(split="train").task_source.get_task(i)["question"] for i in range(8)]
    assert a != [test.task_source.get_task(i)["question"] for i in range(8)]
    assert test.task_source.num_tasks == 8 and train.task_source.num_tasks == 16


@pytest.mark.parametrize("dataset,level", [("chain_sum", 0), ("gcd", 0), ("coin_flip", None), ("word_ladder", None)])
def test_eval_questions_never_appear_in_training(dataset, level):
    """A small task space (chain_sum level 0 repeats questions within 2,000 items) still splits cleanly; word_ladder
    has a fixed item list (draws wrap around)."""
    size = 300 if dataset == "word_ladder" else 2000
    train = reasoning_gym.ReasoningGymTasks(dataset, split="train", size=size, level=level)
    test = reasoning_gym.ReasoningGymTasks(dataset, split="test", num_test=40, level=level)
    train_q = {train.get_task(i)["question"] for i in range(size)}
    test_q = {test.get_task(i)["question"] for i in range(40)}
    assert train_q.isdisjoint(test_q) and len(test_q) > 1
    assert all(reasoning_gym.held_out(q) for q in test_q) and not any(reasoning_gym.held_out(q) for q in train_q)


def test_task_space_without_held_out_questions_fails_at_construction():
    with pytest.raises(ValueError, match="coin_flip: no test question in 256 draws"):
        reasoning_gym.ReasoningGymTasks("coin_flip", split="test", num_test=4, level=0)  # 3 flips: a handful of questions
    assert reasoning_gym.ReasoningGymTasks("coin_flip", split="train", size=4, level=0).get_task(3)["question"]


def test_level_uses_library_curriculum():
    easy = make("chain_sum", level=0).task_source.dataset.config
    hard = make("chain_sum", level=reasoning_gym.max_level("chain_sum")).task_source.dataset.config
    assert (easy.max_terms, easy.max_digits) < (hard.max_terms, hard.max_digits)


def test_config_as_json_string_or_mapping():
    a = make(config='{"min_terms": 2, "max_terms": 2}').task_source.dataset.config
    b = make(config={"min_terms": 2, "max_terms": 2}).task_source.dataset.config
    assert a.max_terms == b.max_terms == 2


def test_composite_default_config_builds():
    env = make("composite")
    assert env.golden_check().status == "verified"


@pytest.mark.parametrize("kwargs,match", [
    ({"dataset": "chain_summ"}, r"unknown dataset 'chain_summ'; did you mean \['chain_sum'"),
    ({"dataset": None}, r"kwarg 'dataset' is required"),
    ({"config": {"bogus": 1}}, r"unknown config key\(s\) \['bogus'\]"),
    ({"config": {"seed": 1}}, r"config key 'seed' is set by the env kwarg"),
    ({"config": "{not json"}, r"config is not valid JSON"),
    ({"config": {"min_terms": 5, "max_terms": 2}}, r"chain_sum: invalid config"),
    ({"level": 99}, r"level must be an int in \[0, "),
    ({"split": "dev"}, r"split must be 'train' or 'test'"),
    ({"size": 0}, r"size must be an int >= 1"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, match):
    kwargs = {"dataset": "chain_sum", "size": 4, "num_test": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        reasoning_gym.ReasoningGymEnv(**kwargs)


def test_unverified_dataset_refused_unless_allowed():
    with pytest.raises(RuntimeError, match="unverified.*allow_unverified=True"):
        make("rush_hour")
    env = make("rush_hour", allow_unverified=True)
    assert env.golden_check().status == "unverified"


def test_failed_golden_check_raises():
    with pytest.raises(RuntimeError, match="puzzle24.*failed"):
        make("puzzle24")


def test_env_module_never_imports_jax():
    code = ("import sys, envs.tasks.reasoning_gym as r, envs.tasks.domains as d; r.ReasoningGymEnv(dataset='chain_sum', size=4);"
            "d.select('reasoning_gym/chain_sum'); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_library_prints_go_to_stderr_not_our_stdout(capfd):
    """reasoning-gym's bf generator prints "." to stdout per program; a command's stdout (`posttrain domains`,
    `status --json`) must carry only its own output."""
    source = reasoning_gym.ReasoningGymTasks("bf", split="train", size=2, seed=0)
    assert source.get_task(0)["question"]
    out, err = capfd.readouterr()
    assert out == "" and "." in err


@pytest.mark.parametrize("answer_of, reward", [
    (lambda g: g, 1.0),
    (lambda g: g + "!", None),                       # punctuation around the gold: the scorer's partial credit
    (lambda g: f"{int(g) + 1} {g}", 0.0),            # a list of candidates: paid 0.45 for chain_sum's -1048
    (lambda g: f"{g} or {int(g) - 1}", 0.0),
    (lambda g: str(int(g) + 1), 0.0),
])
def test_containment_credit_needs_one_answer(answer_of, reward):
    """reasoning-gym's scorers pay len(gold) / len(answer) for any answer containing the gold text (chain_sum:
    `compute_decimal_reward`); a hedged list of candidates kept a share of the reward. Now only punctuation and
    spaces may surround it."""
    env = make("chain_sum")
    env.reset(seed=0)
    gold = env.task["answer"]
    _, got, *_ = env.step(f"<answer>{answer_of(gold)}</answer>")
    assert got == (reward if reward is not None else pytest.approx(len(gold) / (len(gold) + 1)))
