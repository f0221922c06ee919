"""The collapse check (posttrain/eval/collapse.py) against a NumPy reference over a table of cases, and its place in
the suite summary (runner.suite_summary, report.summary_markdown) beside above_floor (runner.loop_metrics)."""
import math

import numpy as np
import pytest

from posttrain.eval import collapse, report, runner


def reference(answers, gold, alpha=collapse.ALPHA, margin=collapse.MARGIN):
    """NumPy reference: modal shares by np.unique, the exact one-sided binomial tail sum_{i >= k} C(n,i) p^i q^(n-i)."""
    norm = lambda xs: [" ".join(str(x).split()).lower() for x in xs if x is not None and str(x).strip()]  # noqa: E731
    a, g = norm(answers), norm(gold)
    k = int(np.unique(a, return_counts=True)[1].max()) if a else 0
    n = len(answers)
    share = k / n
    if not g:
        return share, None, None, False
    p0 = np.unique(g, return_counts=True)[1].max() / len(g)
    tail = float(np.sum([math.comb(n, i) * p0 ** i * (1 - p0) ** (n - i) for i in range(k, n + 1)])) if k else 1.0
    return share, p0, tail, bool(share >= p0 + margin and tail < alpha)


GOLD30 = [str(1 + i % 3) if i % 10 else "4" for i in range(30)]  # modal gold share 9/30
CASES = [
    ("letter_counting: 29/30 replies '1'", ["1"] * 29 + ["2"], GOLD30, True),
    ("the gold answers themselves", GOLD30[::-1], GOLD30, False),
    ("all 'yes' where the gold is all 'yes'", ["yes"] * 20, ["Yes"] * 20, False),
    ("no gold answers: nothing flagged", ["1"] * 10, [None] * 10, False),
    ("mostly no answer: no answer is not a mode", [None] * 20 + ["1"] * 10, GOLD30, False),
    ("4 of 5 the same against a 0.2 gold share", ["7", "7", "7", " 7 ", "3"], ["1", "2", "3", "4", "5"], True),
    ("3 of 5: not significant at 0.01", ["7", "7", "7", "2", "3"], ["1", "2", "3", "4", "5"], False),
]


@pytest.mark.parametrize("name,answers,gold,flagged", CASES, ids=[c[0] for c in CASES])
def test_collapse_check_matches_the_reference(name, answers, gold, flagged):
    got = collapse.collapse_check(answers, gold)
    share, gold_share, p, want = reference(answers, gold)
    assert got.collapsed == want == flagged
    assert got.modal_share == pytest.approx(share) and got.replies == len(answers)
    assert (got.gold_modal_share is None) == (gold_share is None)
    if gold_share is not None:
        assert got.gold_modal_share == pytest.approx(gold_share) and got.p == pytest.approx(p, rel=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="no replies"):
        collapse.collapse_check([], ["1"])
    with pytest.raises(ValueError, match="alpha=1.5"):
        collapse.collapse_check(["1"], ["1"], alpha=1.5)


def _records(domain, replies, golds, reward):
    return [{"domain": domain, "area": "counting", "task_id": i, "prompt": f"q{i}", "replies": [r],
             "rewards": [reward(r, g)], "gold": g, "greedy": True} for i, (r, g) in enumerate(zip(replies, golds))]


def test_suite_summary_flags_a_collapsed_domain_and_reports_above_floor():
    paid = lambda r, g: float(f"<answer>{g}</answer>" == r)  # noqa: E731
    lc = _records("reasoning_gym/letter_counting", ["<answer>1</answer>"] * 29 + ["The answer is 2."], GOLD30, paid)
    honest = _records("reasoning_gym/gcd", [f"<answer>{g}</answer>" for g in GOLD30], GOLD30, paid)
    s = runner.suite_summary(lc + honest, floors={"reasoning_gym/letter_counting": 0.3})
    d = s["domains"]["reasoning_gym/letter_counting"]
    assert (d["collapsed"], d["modal_share"], d["gold_modal_share"]) == (1.0, pytest.approx(29 / 30), 0.3)
    assert d["above_floor"] == pytest.approx(d["mean_reward"] - 0.3) and d["mean_reward"] == pytest.approx(9 / 30)
    gcd = s["domains"]["reasoning_gym/gcd"]
    assert gcd["collapsed"] == 0.0 and "above_floor" not in gcd
    table = report.summary_markdown(s)
    assert "| - reasoning_gym/letter_counting COLLAPSED |" in table and "above_floor" in table
    assert "reasoning_gym/gcd COLLAPSED" not in table
    m = runner.loop_metrics(lc, {"reasoning_gym/letter_counting": 0.3})
    assert m["eval/reasoning_gym/letter_counting/above_floor"] == pytest.approx(0.0)
    assert "eval/reasoning_gym/letter_counting/above_floor" not in runner.loop_metrics(lc)
    carried = [{**r, "floor": 0.3} for r in lc]  # runner.task_record stores the domain's floor in each record
    assert runner.loop_metrics(carried)["eval/reasoning_gym/letter_counting/above_floor"] == pytest.approx(0.0)
    assert runner.suite_summary(carried)["domains"]["reasoning_gym/letter_counting"]["above_floor"] == pytest.approx(0)


def test_episode_floor_reads_the_registry():
    from posttrain.rollout.episodes import Episode

    coin = Episode("posttrain/ReasoningGym-v0", {"dataset": "coin_flip", "config": "{}"}, {}, seed=0)
    assert runner.episode_floor(coin) == pytest.approx(0.95)
    assert runner.episode_floor(Episode("user:Fake-v0", {}, {}, seed=0)) is None
    assert runner.env_floor("posttrain/ReasoningGym-v0", {"config": "{}"}) is None  # no dataset: no floor


def test_letter_counting_records_scored_by_the_real_env_collapse_at_29_of_30_ones():
    """30 held-out letter_counting tasks of reasoning-gym (the registry's default config, the reasoning_mix run's),
    replies rescored by the env (`records.rescore`, the --from_records path): "<answer>1</answer>" on 29 of them
    is flagged as collapsed; the gold answers as replies are not."""
    import gymnasium

    from posttrain.eval import records as records_lib

    kwargs = {"dataset": "letter_counting", "config": "{}", "split": "test", "num_test": 30}
    source = gymnasium.make("posttrain/ReasoningGym-v0", **kwargs).unwrapped.task_source
    tasks = [source.get_task(i) for i in range(30)]
    spec = {"env_id": "posttrain/ReasoningGym-v0", "env_kwargs": kwargs, "scorer": "env", "format": "answer_tag"}

    def records(replies):
        return records_lib.rescore(
            [{"domain": "lc", "area": "counting", "task_id": t["id"], "index": i, "prompt": t["question"],
              "replies": [reply], "gold": str(t["answer"]), "greedy": True}
             for i, (t, reply) in enumerate(zip(tasks, replies))], {"lc": spec})

    gamed = records(["<answer>1</answer>"] * 29 + [f"<answer>{tasks[29]['answer']}</answer>"])
    honest = records([f"<answer>{t['answer']}</answer>" for t in tasks])
    assert all(r["correct"] == [True] for r in honest)  # the env pays the gold answer
    paid = sum(r["correct"][0] for r in gamed)
    assert paid == sum(str(t["answer"]) == "1" for t in tasks[:29]) + 1  # "1" earns exactly where the gold is 1
    got = runner.suite_summary(gamed)["domains"]["lc"]
    assert got["collapsed"] == 1.0 and got["modal_share"] == pytest.approx(29 / 30)
    assert got["gold_modal_share"] < 29 / 30 - collapse.MARGIN
    assert runner.suite_summary(honest)["domains"]["lc"]["collapsed"] == 0.0



@pytest.mark.parametrize("count,n,p", [(5, 10, 0.3), (1, 4, 0.5), (10, 10, 0.9), (3, 40, 0.01), (5, 5, 1.0),
                                       (3, 5, 1.0), (5, 5, 0.0), (1, 1, 0.5), (29, 30, 0.3)])
def test_upper_tail_p_equals_scipy_binomtest(count, n, p):
    from scipy import stats

    want = stats.binomtest(count, n, p, alternative="greater").pvalue
    np.testing.assert_allclose(collapse.upper_tail_p(count, n, p), want, rtol=1e-12, atol=1e-300)
