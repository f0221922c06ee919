"""posttrain.eval.runner and .records with a scripted sampler (no model): per-task records through real envs, the
loop's eval/* keys, per-domain / per-area summaries with unbiased pass@k, answer formats, and rescoring of
written records without sampling."""
import json

import numpy as np
import pytest

from helpers import scripted_output
from posttrain.eval import metrics, records as records_lib, runner
from posttrain.model.tokenizer import Tokenizer
from posttrain.rollout.episodes import InlineEnvs
from posttrain.rollout.env_side import task_sources
from posttrain.config import EnvSpec

TOK = Tokenizer.byte_level()
SPEC = EnvSpec(id="posttrain/Arithmetic-v0", kwargs={"split": "test", "digits": 1, "num_test": 20})


def scripted(reply_of, budget=40):
    """A sample_fn whose reply to the prompt text and sample index g is `reply_of(prompt, g)` (cut at `budget`
    tokens: truncated, else a stop token follows)."""
    def fn(prompts, lengths, key, group_size):
        rows = []
        for p in range(len(prompts)):
            text = TOK.decode(prompts[p, :lengths[p]].tolist())
            for g in range(group_size):
                ids = TOK.encode(reply_of(text, g))
                rows.append(ids[:budget] if len(ids) >= budget else ids + [TOK.stop_ids[0]])
        return scripted_output(rows, TOK.pad_id, truncated_N=[len(r) >= budget for r in rows])
    return fn


def answer(prompt: str) -> int:
    a, b = (int(x) for x in prompt.split("What is ")[1].split("?")[0].split(" + "))
    return a + b


def _episodes(num_tasks=6):
    return runner.eval_episodes(task_sources({"arith": SPEC}), num_tasks)["arith"]


def _records(reply_of, *, n=1, greedy=True, scorer="env", fmt="number", num_tasks=6, budget=40):
    return runner.sample_domain(scripted(reply_of, budget), TOK, InlineEnvs(), _episodes(num_tasks), batch_size=4,
                                num_samples=n, scorer=scorer, fmt=fmt, greedy=greedy, area="math")


def test_records_hold_prompt_replies_rewards_statuses_formats_lengths():
    recs = _records(lambda p, g: f"{answer(p)}" if answer(p) % 2 else "I think it is big")
    assert [r["index"] for r in recs] == list(range(6))
    for r in recs:
        solved = answer(r["prompt"]) % 2 == 1
        assert r["domain"] == "arith" and r["area"] == "math" and r["task_id"] == f"arithmetic-test-{r['index']}"
        assert "What is" in r["prompt"] and "<|im_start|>" in r["prompt"]  # the prompt as the model saw it
        assert r["rewards"] == [float(solved)] and r["correct"] == [solved] and r["formatted"] == [solved]
        assert r["statuses"] == ["ok" if solved else "wrong"] and r["greedy"] and r["gold"] == str(answer(r["prompt"]))
        assert r["lengths"] == [len(TOK.encode(r["replies"][0])) + 1] and r["truncated"] == [False]
    m = runner.loop_metrics(recs)
    share = np.mean([answer(r["prompt"]) % 2 for r in recs])
    floor = recs[0]["floor"]  # the arithmetic domain's gaming floor (envs/tasks/domain_floors.json)
    assert m == {"eval/arith/pass@1": pytest.approx(share), "eval/arith/mean_reward": pytest.approx(share),
                 "eval/arith/above_floor": pytest.approx(share - floor), "eval/pass@1": pytest.approx(share)}


def test_scorers_formats_and_truncation():
    recs = _records(lambda p, g: f"The sum is {answer(p)}, <answer>{answer(p)}</answer>", scorer="last_integer",
                    fmt="answer_tag", budget=11)
    assert all(r["truncated"] == [True] and r["lengths"] == [11] for r in recs)
    assert all(r["correct"] == [False] and r["formatted"] == [False] for r in recs)  # cut to "The sum is "
    table = {"nonempty": ("x", " \n"), "number": ("it is 7", "seven"), "hash": ("so\n#### 12", "## 12"),
             "boxed": ("\\boxed{3}", "boxed 3"), "answer_tag": ("<answer>3</answer>", "<answer>3"),
             "code_block": ("```python\ndef f(): pass\n```", "def f(): pass")}
    assert set(table) == set(runner.FORMATS)
    for name, (good, bad) in table.items():
        assert runner.FORMATS[name](good) and not runner.FORMATS[name](bad), name
    assert runner.solved_by_last_integer("= 1,234", 0.0, {"gold": "1234"}) is False  # the rule reads 234
    assert runner.solved_by_last_integer("so 42.", 0.0, {"answer": "42"})


def test_sampled_domain_pass_at_k_and_area_summary():
    # sample g of task i is right when g < i % 5 (c = 0..4 of n = 4), so pass@2 is the exact unbiased value
    recs = _records(lambda p, g: f"{answer(p) + (g >= answer(p) % 5)}", n=4, greedy=False, num_tasks=8)
    c = [sum(r["correct"]) for r in recs]
    assert c == [min(4, answer(r["prompt"]) % 5) for r in recs]
    greedy = [dict(r, domain="other", area="logic", **{k: r[k][:1] for k in ("rewards", "correct", "formatted",
                                                                           "lengths", "truncated", "statuses")})
              for r in _records(lambda p, g: "0", num_tasks=4)]
    s = runner.suite_summary(recs + greedy, {"arith": (2,)})
    assert s["domains"]["arith"]["pass@2"] == pytest.approx(np.mean([metrics.pass_at_k(4, x, 2) for x in c]))
    assert s["domains"]["arith"]["pass@1"] == pytest.approx(np.mean(c) / 4)
    assert "pass@2" not in s["domains"]["other"] and "pass@2" not in s["all"]  # other has n = 1
    assert s["areas"]["math"]["tasks"] == 8 and s["areas"]["logic"]["pass@1"] == 0.0
    assert s["all"]["pass@1"] == pytest.approx((np.mean(c) / 4 * 8) / 12)  # task weighted
    assert s["area_of"] == {"arith": "math", "other": "logic"}


def test_records_round_trip_and_rescore_without_sampling(tmp_path):
    recs = _records(lambda p, g: f"{answer(p)}." if answer(p) > 9 else f"<answer>{answer(p)}</answer>")
    h = metrics.task_set_hash(recs)
    records_lib.write_evaluation(tmp_path, recs, {"task_set_hash": h})
    back, results = records_lib.read_evaluation(tmp_path)
    assert back == json.loads(json.dumps(recs)) and results["task_set_hash"] == h
    spec = {"env_id": SPEC.id, "env_kwargs": dict(SPEC.kwargs)}
    same = records_lib.rescore(back, {"arith": {**spec, "scorer": "env", "format": "number"}})
    assert [r["rewards"] for r in same] == [r["rewards"] for r in recs]
    assert [r["correct"] for r in same] == [r["correct"] for r in recs]
    tagged = records_lib.rescore(back, {"arith": {**spec, "scorer": "env", "format": "answer_tag"}})
    assert [r["formatted"] for r in tagged] == [[answer(r["prompt"]) <= 9] for r in recs]
    with pytest.raises(ValueError, match="not in the suite"):
        records_lib.rescore(back, {})
    (tmp_path / "records.jsonl").write_text(json.dumps({**recs[0], "prompt": "edited"}) + "\n")
    with pytest.raises(ValueError, match="does not match its records"):
        records_lib.read_evaluation(tmp_path)
