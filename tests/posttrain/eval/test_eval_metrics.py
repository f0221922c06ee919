"""posttrain.eval.metrics against references: Chen et al.'s pass@k (exact binomials), means, the task-set hash."""
import math
from fractions import Fraction

import numpy as np
import pytest

from posttrain.eval import metrics


def exact_pass_at_k(n, c, k):
    """1 - C(n-c, k) / C(n, k) in exact rationals (math.comb(n - c, k) is 0 when n - c < k)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def chen_numpy(n, c, k):
    """The numpy snippet of Chen et al. 2021, verbatim."""
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


PASS_AT_K_TABLE = [
    # n = k
    (5, 0, 5), (5, 1, 5), (5, 5, 5), (1, 0, 1), (1, 1, 1),
    # c = 0 and c = n
    (10, 0, 3), (10, 10, 3), (50, 0, 1), (50, 50, 7),
    # n = 2k
    (10, 3, 5), (20, 7, 10), (4, 1, 2), (4, 2, 2), (4, 3, 2),
    # k = 1 is c / n
    (7, 3, 1), (200, 13, 1),
    # large n
    (200, 10, 10), (200, 1, 10), (200, 0, 10), (200, 190, 10), (1000, 37, 100), (2000, 5, 50),
]


@pytest.mark.parametrize("n,c,k", PASS_AT_K_TABLE)
def test_pass_at_k_matches_exact_binomials_and_chen(n, c, k):
    got = metrics.pass_at_k(n, c, k)
    assert got == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-12, abs=1e-12)
    assert got == pytest.approx(chen_numpy(n, c, k), rel=1e-15, abs=0)
    assert 0.0 <= got <= 1.0


def test_pass_at_k_edges_and_errors():
    assert metrics.pass_at_k(10, 0, 3) == 0.0
    assert metrics.pass_at_k(10, 10, 3) == 1.0
    assert metrics.pass_at_k(7, 3, 1) == pytest.approx(3 / 7)
    assert metrics.pass_at_k(np.int64(6), np.int64(2), 3) == pytest.approx(exact_pass_at_k(6, 2, 3))
    for bad in [(3, 1, 4), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3.5, 1, 1), (3, True, 1)]:
        with pytest.raises(ValueError):
            metrics.pass_at_k(*bad)


def test_pass_at_k_is_monotone_in_k_and_c():
    n = 40
    grid = np.array([[metrics.pass_at_k(n, c, k) for k in range(1, n + 1)] for c in range(n + 1)])
    assert np.all(np.diff(grid, axis=0) >= -1e-15)  # more correct samples never lower pass@k
    assert np.all(np.diff(grid, axis=1) >= -1e-15)  # a larger k never lowers it


def test_pass_at_1_greedy_and_sampled():
    assert metrics.pass_at_1([True], greedy=True) == 1.0
    assert metrics.pass_at_1([False, True, True, False]) == 0.5
    with pytest.raises(ValueError, match="greedy"):
        metrics.pass_at_1([True, True], greedy=True)
    with pytest.raises(ValueError, match="no samples"):
        metrics.pass_at_1([])
    rec = {"domain": "d", "task_id": 0, "rewards": [1.0, 0.5, 0.0, 1.0]}
    assert metrics.task_pass_at_1(rec) == 0.5  # correct defaults to reward >= 1
    rec_c = dict(rec, correct=[True, True, False, False])
    assert metrics.task_pass_at_1(rec_c) == 0.5 and metrics.task_pass_at_k(rec_c, 2) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="3 correct flags but 4 rewards"):
        metrics.correct_of(dict(rec, correct=[True, False, True]))


def _rec(domain, tid, rewards, **kw):
    return {"domain": domain, "task_id": tid, "prompt": f"{domain}:{tid}", "rewards": rewards, **kw}


def test_summarize_per_domain_against_hand_values():
    records = [
        _rec("a", 0, [1.0, 0.0, 0.0, 0.0], formatted=[1, 1, 0, 1], lengths=[10, 20, 30, 40], truncated=[0, 0, 0, 1]),
        _rec("a", 1, [1.0, 1.0, 0.5, 0.0], formatted=[1, 1, 1, 1], lengths=[5, 5, 5, 5], truncated=[0, 0, 0, 0]),
        _rec("b", "x", [0.0, 0.0]),
        _rec("b", "y", [1.0, 0.0]),
    ]
    s = metrics.summarize(records, ks=(1, 2, 4))
    a, b = s["a"], s["b"]
    assert a["tasks"] == 2 and a["n_min"] == 4
    assert a["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert a["pass@2"] == pytest.approx((exact_pass_at_k(4, 1, 2) + exact_pass_at_k(4, 2, 2)) / 2)
    assert a["pass@4"] == pytest.approx(1.0)
    assert a["mean_reward"] == pytest.approx((0.25 + 0.625) / 2)
    assert a["format_rate"] == pytest.approx((0.75 + 1.0) / 2)
    assert a["mean_length"] == pytest.approx((25 + 5) / 2)
    assert a["truncation_rate"] == pytest.approx(0.125)
    assert "pass@4" not in b and b["pass@2"] == pytest.approx(0.5)  # n = 2 < 4: pass@4 left out
    assert "format_rate" not in b and b["pass@1"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="1 of 2 records have 'formatted'"):
        metrics.summarize([records[0], _rec("a", 5, [1.0])])
    with pytest.raises(ValueError, match="appears twice"):
        metrics.summarize([records[2], records[2]])


def test_metric_registry():
    assert set(metrics.TASK_METRICS) == {"pass@1", "mean_reward", "format_rate", "mean_length", "truncation_rate"}
    rec = _rec("a", 0, [1.0, 0.0, 1.0])
    assert metrics.metric_fn("pass@3")(rec) == 1.0 and metrics.metric_fn("pass@2")(rec) == pytest.approx(1.0)
    np.testing.assert_allclose(metrics.per_task([rec, _rec("a", 1, [0.0, 0.0, 0.0])], "pass@1"), [2 / 3, 0.0])
    for bad in ("accuracy", "pass@0", "pass@x"):
        with pytest.raises(KeyError):
            metrics.metric_fn(bad)


def test_task_set_hash():
    recs = [_rec("a", 0, [1.0]), _rec("a", 1, [0.0]), _rec("b", "0", [1.0])]
    h = metrics.task_set_hash(recs)
    assert len(h) == 64 and h == metrics.task_set_hash(recs[::-1])
    assert h == metrics.task_set_hash([dict(r, rewards=[0.0], replies=["other"]) for r in recs])
    assert h != metrics.task_set_hash([dict(recs[0], prompt="changed"), *recs[1:]])
    assert h != metrics.task_set_hash([*recs[:2], dict(recs[2], task_id=0)])  # id "0" vs 0
    assert h != metrics.task_set_hash(recs[:2])
    with pytest.raises(ValueError, match="prompt"):
        metrics.task_set_hash([{"domain": "a", "task_id": 0}])
    with pytest.raises(ValueError, match="twice"):
        metrics.task_set_hash([recs[0], recs[0]])
