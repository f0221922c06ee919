"""The gate's decisions from tables of verdicts: regressions beyond max_drop, the action, the trained score and the
best checkpoint; and its metrics."""
import pytest

from posttrain.eval import gate
from posttrain.eval.gate import DomainRow as R


@pytest.mark.parametrize("rows,max_drop,expected", [
    ([R("a", "regressed", 0.8, 0.2)], 0.0, {"a": pytest.approx(0.6)}),
    ([R("a", "regressed", 0.8, 0.2)], 0.5, {"a": pytest.approx(0.6)}),
    ([R("a", "regressed", 0.8, 0.5)], 0.5, {}),  # significant but within the allowed drop
    ([R("a", "no change", 0.8, 0.0)], 0.0, {}),  # a large drop that is not significant does not count
    ([R("a", "improved", 0.2, 0.8), R("b", "regressed", 0.5, 0.25)], 0.1, {"b": pytest.approx(0.25)}),
    ([R("a", "no change", 0.5, 0.5), R("b", "no change", 0.3, 0.3)], 0.0, {}),  # A/A: nothing
])
def test_regressions_table(rows, max_drop, expected):
    assert gate.regressions(rows, max_drop) == expected


@pytest.mark.parametrize("action,rows,want", [
    ("stop", [R("a", "regressed", 1.0, 0.0)], "stop"),
    ("warn", [R("a", "regressed", 1.0, 0.0)], "warn"),
    ("stop", [R("a", "no change", 1.0, 1.0)], "pass"),
    ("stop", [R("a", "improved", 0.0, 1.0)], "pass"),
])
def test_action_table(action, rows, want):
    assert gate.decide(rows, step=3, action=action, max_drop=0.0, trained=["a"]).action == want


def test_trained_score_is_task_weighted_over_trained_domains():
    rows = [R("a", "no change", 0, 1.0, tasks=30), R("b", "no change", 0, 0.0, tasks=10), R("c", "no change", 0, 0.5, 100)]
    assert gate.trained_score(rows, ["a", "b"]) == pytest.approx(30 / 40)
    assert gate.trained_score(rows, []) == pytest.approx((30 + 50) / 140)  # no trained domain: every domain
    with pytest.raises(ValueError, match="no domains"):
        gate.trained_score([], ["a"])


def test_best_checkpoint_follows_the_score_ties_go_to_the_later_step():
    best, seen = None, []
    for step, score in [(2, 0.5), (4, 0.75), (6, 0.25), (8, 0.75)]:
        d = gate.decide([R("a", "no change", 0.5, score)], step=step, action="warn", max_drop=0.0, trained=["a"],
                        best=best)
        best = (d.best_step, d.best_score)
        seen.append((d.new_best, d.best_step))
    assert seen == [(True, 2), (True, 4), (False, 4), (True, 8)]


def test_metrics_and_bad_input():
    rows = [R("a", "regressed", 0.9, 0.1), R("b", "improved", 0.1, 0.6)]
    d = gate.decide(rows, step=5, action="stop", max_drop=0.2, trained=["b"])
    m = gate.gate_metrics(d, rows)
    assert m["eval/gate/stop"] == 1.0 and m["eval/gate/warn"] == 0.0 and m["eval/gate/regressed"] == 1.0
    assert m["eval/gate/improved"] == 1.0 and m["eval/gate/score"] == pytest.approx(0.6)
    assert m["eval/gate/best_step"] == 5.0 and m["eval/gate/a/diff"] == pytest.approx(-0.8)
    assert "a (pass@1 -0.800)" in gate.message(d, "T.md") and "stopping" in gate.message(d, "T.md")
    assert d.to_dict()["regressed"] == {"a": pytest.approx(0.8)}
    with pytest.raises(ValueError, match="'halt'"):
        gate.decide(rows, step=1, action="halt", max_drop=0.0, trained=[])
    with pytest.raises(ValueError, match="'worse'"):
        gate.regressions([R("a", "worse", 1, 0)], 0.0)
    with pytest.raises(ValueError, match="max_drop"):
        gate.regressions(rows, 1.0)
