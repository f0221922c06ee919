"""Infra-error samples in evaluation (status "infra_error": the env or its sandbox failed) are unscored, never wrong
answers: `metrics.scored_only`, the loop's eval metrics, the suite summary and its table, and the paired comparison,
each against the same computation on records that never had those samples."""
import numpy as np
import pytest

from posttrain.eval import metrics, report, runner
from posttrain.eval.compare import compare

IE = "infra_error"


def _record(domain, task, statuses, rewards, **extra):
    n = len(statuses)
    return {"domain": domain, "task_id": task, "prompt": f"{domain} {task}", "statuses": list(statuses),
            "rewards": list(rewards), "correct": [r >= 1 for r in rewards], "replies": [f"r{i}" for i in range(n)],
            "formatted": [True] * n, "lengths": list(range(1, n + 1)), "truncated": [False] * n, **extra}


def test_scored_only_keeps_the_scored_samples_of_every_field_and_counts_the_rest():
    records = [_record("a", 0, ["ok", IE, "wrong"], [1.0, 0.0, 0.0], turns=[["x"], ["y"], ["z"]]),
               _record("a", 1, [IE, IE], [0.0, 0.0]),
               _record("b", 0, ["ok"], [1.0]),
               {"domain": "c", "task_id": 0, "rewards": [1.0, 0.0]}]  # no statuses: every sample scored
    kept, counts = metrics.scored_only(records)
    assert [(r["domain"], r["task_id"]) for r in kept] == [("a", 0), ("b", 0), ("c", 0)]
    first = kept[0]
    assert (first["statuses"], first["rewards"], first["correct"], first["replies"], first["lengths"],
            first["turns"]) == (["ok", "wrong"], [1.0, 0.0], [True, False], ["r0", "r2"], [1, 3], [["x"], ["z"]])
    assert first["prompt"] == "a 0" and records[0]["rewards"] == [1.0, 0.0, 0.0]  # the input is not changed
    assert counts == {"a": {"infra_errors": 3, "unscored_tasks": 1, "samples": 5},
                      "b": {"infra_errors": 0, "unscored_tasks": 0, "samples": 1},
                      "c": {"infra_errors": 0, "unscored_tasks": 0, "samples": 2}}
    for name in ("pass@1", "mean_reward", "format_rate", "pass@2"):  # a metric never counts an unscored sample
        with pytest.raises(ValueError, match="unscored"):
            metrics.metric_fn(name)(records[0])
    with pytest.raises(ValueError, match="2 statuses but 3 rewards"):
        metrics.scored_only([_record("a", 0, ["ok", "ok"], [1.0, 0.0]) | {"rewards": [1.0, 0.0, 0.0]}])


def test_loop_metrics_are_over_the_scored_samples_and_name_the_infra_errors(caplog):
    records = [_record("a", 0, ["ok"], [1.0]), _record("a", 1, [IE], [0.0]), _record("a", 2, ["wrong"], [0.0]),
               _record("dead", 0, [IE], [0.0]), _record("dead", 1, [IE], [0.0]),
               _record("fine", 0, ["ok"], [1.0])]
    m = runner.loop_metrics(records)
    assert m["eval/a/pass@1"] == 0.5 and m["eval/a/infra_error_rate"] == pytest.approx(1 / 3)  # not 1/3 solved
    assert m["eval/a/unscored_tasks"] == 1.0 and m["eval/dead/infra_error_rate"] == 1.0
    assert "eval/dead/pass@1" not in m and "eval/dead/mean_reward" not in m
    assert "eval/fine/infra_error_rate" not in m  # only domains that had one: the usual metrics are unchanged
    assert m["eval/pass@1"] == pytest.approx(np.mean([1.0, 0.0, 1.0]))  # the three scored tasks
    assert "dead: 2 of 2 samples ended in infra_error" in caplog.text and "no task was scored" in caplog.text
    only_dead = runner.loop_metrics([r for r in records if r["domain"] == "dead"])
    assert "eval/pass@1" not in only_dead and only_dead["eval/dead/infra_error_rate"] == 1.0  # no headline 0


def test_suite_summary_and_table_show_unscored_tasks_instead_of_zeros():
    records = [dict(_record("a", t, [IE if t == 0 else "ok", "ok"], [0.0, 1.0]), area="x") for t in range(3)]
    records += [dict(_record("dead", t, [IE, IE], [0.0, 0.0]), area="x") for t in range(2)]
    records += [dict(_record("b", 0, ["wrong", "ok"], [0.0, 1.0]), area="y")]
    s = runner.suite_summary(records, ks={"a": (2,), "b": (2,)})
    a, dead = s["domains"]["a"], s["domains"]["dead"]
    # task 0 keeps its one scored sample (solved), tasks 1 and 2 are 1 of 2; pass@2 needs 2 samples of every task
    assert a["tasks"] == 3 and a["n_min"] == 1 and a["pass@1"] == pytest.approx(2 / 3) and "pass@2" not in a
    assert (a["infra_errors"], a["unscored_tasks"]) == (1, 0)
    assert dead == {"tasks": 0, "n_min": 0, "infra_errors": 4, "unscored_tasks": 2}
    assert s["areas"]["x"]["tasks"] == 3 and s["areas"]["x"]["infra_errors"] == 5
    assert s["all"]["tasks"] == 4 and s["all"]["pass@1"] == pytest.approx((1 + 0.5 + 0.5 + 0.5) / 4)
    assert list(s["domains"]) == ["a", "dead", "b"]
    table = report.summary_markdown(s)
    assert "infra errors (tasks unscored) |" in table.splitlines()[0]
    dead_row = next(line for line in table.splitlines() if "dead" in line)
    assert dead_row.startswith("| - dead UNSCORED | 0 | 0 | - |") and dead_row.endswith("| 4 (2) |")
    clean = runner.suite_summary([_record("b", 0, ["ok"], [1.0])])
    assert "infra" not in report.summary_markdown(clean)  # the usual table when nothing failed


def test_comparison_pairs_only_tasks_scored_on_both_sides():
    rng = np.random.default_rng(0)
    base_ok, cand_ok = rng.random(40) < 0.4, rng.random(40) < 0.7
    broken = {3, 7, 11, 20}  # the candidate's verifier crashed on these tasks
    base = [_record("a", t, ["ok" if base_ok[t] else "wrong"], [float(base_ok[t])]) for t in range(40)]
    cand = [_record("a", t, [IE] if t in broken else ["ok" if cand_ok[t] else "wrong"],
                    [0.0] if t in broken else [float(cand_ok[t])]) for t in range(40)]
    base += [_record("dead", t, ["ok"], [1.0]) for t in range(5)]
    cand += [_record("dead", t, [IE], [0.0]) for t in range(5)]
    got = compare(base, cand, n_resamples=999)
    keep = [t for t in range(40) if t not in broken]
    want = compare([base[t] for t in keep], [cand[t] for t in keep], n_resamples=999)  # as if never sampled
    (d,), (w,) = got.domains, want.domains
    assert (d.tasks, d.unscored, d.wins, d.losses) == (36, 4, w.wins, w.losses) and w.unscored == 0
    assert d.pass_at_1 == w.pass_at_1 and d.mean_reward == w.mean_reward
    assert got.unscored_domains == ("dead",)
    md, js = report.comparison_markdown(got), report.comparison_dict(got)
    assert "a: 4 task(s); dead: every task (not tested)" in md
    assert js["unscored_domains"] == ["dead"] and js["domains"][0]["unscored"] == 4
    with pytest.raises(ValueError, match=r"no task is scored on both sides: every sample of \['dead'\]"):
        compare([r for r in base if r["domain"] == "dead"], [r for r in cand if r["domain"] == "dead"])
