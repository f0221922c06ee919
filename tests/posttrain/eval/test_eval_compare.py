"""posttrain.eval.compare against references: scipy's binomtest, a hand-computed Holm table, bootstrap coverage,
degenerate samples, self-comparison, planted effects and refusals."""
import numpy as np
import pytest
from scipy import stats

from posttrain.eval import compare as compare_lib
from posttrain.eval.compare import compare
from posttrain.eval.metrics import task_set_hash


def _records(domain, outcomes_T, *, n=1, reward=None):
    """Records with one sample per task (outcomes_T of 0/1), or n samples whose first `outcome * n` are correct."""
    out = []
    for t, o in enumerate(outcomes_T):
        if reward is not None:
            rewards = [float(reward[t])]
        elif n == 1:
            rewards = [float(o)]
        else:
            rewards = [1.0] * int(o) + [0.0] * (n - int(o))
        out.append({"domain": domain, "task_id": t, "prompt": f"{domain} task {t}", "rewards": rewards})
    return out


def _paired(domain, both, neither, losses, wins):
    """(baseline, candidate) records of one domain with the given concordant and discordant counts."""
    base = [1] * both + [0] * neither + [1] * losses + [0] * wins
    cand = [1] * both + [0] * neither + [0] * losses + [1] * wins
    return _records(domain, base), _records(domain, cand)


@pytest.mark.parametrize("losses,wins", [(0, 0), (5, 0), (0, 6), (3, 9), (10, 10), (1, 30), (17, 4)])
def test_mcnemar_matches_binomtest(losses, wins):
    got = compare_lib.mcnemar_exact(losses, wins)
    want = 1.0 if losses + wins == 0 else stats.binomtest(wins, losses + wins, 0.5).pvalue
    assert got == pytest.approx(want, rel=1e-12)


def test_mcnemar_issue_example_and_errors():
    assert compare_lib.mcnemar_exact(5, 0) == pytest.approx(0.0625)  # gcd 5/30 -> 0/30: not significant
    assert compare_lib.mcnemar_exact(6, 0) == pytest.approx(0.03125)
    with pytest.raises(ValueError):
        compare_lib.mcnemar_exact(-1, 2)


def test_holm_matches_hand_computed_table():
    # sorted p: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, max(0.04*1, 0.06) = 0.06
    p = [0.01, 0.04, 0.03, 0.005]
    reject, adj = compare_lib.holm(p, 0.05)
    np.testing.assert_allclose(adj, [0.03, 0.06, 0.06, 0.02], rtol=1e-12)
    assert reject.tolist() == [True, False, False, True]
    # a second table: step-down stops at the first non-rejection; adjusted values capped at 1
    reject, adj = compare_lib.holm([0.001, 0.5, 0.012, 0.02, 0.9], 0.05)
    np.testing.assert_allclose(adj, [0.005, 1.0, 0.048, 0.06, 1.0], rtol=1e-12)
    assert reject.tolist() == [True, False, True, False, False]
    assert compare_lib.holm([], 0.05)[0].size == 0
    with pytest.raises(ValueError):
        compare_lib.holm([0.1, 1.2], 0.05)


def test_holm_runs_no_full_garbage_collection(monkeypatch):
    """statsmodels' Holm branch calls gc.collect() (0.42 s a call in a test process, most of a power run's
    comparison time): holm() makes it a no-op for the call and puts gc.collect back afterwards."""
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: calls.append(1) or 0)
    counting = gc.collect
    assert compare_lib.holm([0.01, 0.04], 0.05)[0].tolist() == [True, True]
    assert calls == [] and gc.collect is counting
    with pytest.raises(ValueError):
        compare_lib.holm([0.1], 1.5)


def test_paired_bootstrap_coverage_on_synthetic_binary_pairs():
    # 100 pairs, 30% discordant (P(1,0) = 0.1, P(0,1) = 0.2): true difference 0.1. 1000 trials with a fixed seed;
    # n_resamples = 999 per interval (instead of 9999) keeps the test at ~3 s with the same coverage.
    rng = np.random.default_rng(20240522)
    pairs = np.array([[1, 1], [0, 0], [1, 0], [0, 1]], dtype=float)
    covered = 0
    for trial in range(1000):
        idx = rng.choice(4, size=100, p=[0.4, 0.3, 0.1, 0.2])
        lo, hi = compare_lib.paired_bootstrap_ci(pairs[idx, 0], pairs[idx, 1], confidence=0.95, n_resamples=999,
                                             seed=trial)
        assert np.isfinite(lo) and np.isfinite(hi) and lo <= hi
        covered += lo <= 0.1 <= hi
    assert covered >= 925, covered


def test_all_concordant_gives_zero_interval_and_no_change():
    base, cand = _paired("gcd", both=12, neither=18, losses=0, wins=0)
    assert compare_lib.paired_bootstrap_ci([1, 0, 1], [1, 0, 1]) == (0.0, 0.0)
    d = compare(base, cand).domains[0]
    assert d.pass_at_1.ci == (0.0, 0.0) and d.mean_reward.ci == (0.0, 0.0)
    assert d.verdict == "no change" and d.pass_at_1.p == 1.0 and d.pass_at_1.p_holm == 1.0
    assert np.isfinite(d.pass_at_1.mde) and d.pass_at_1.mde > 0


def test_self_comparison_is_no_change_everywhere():
    rng = np.random.default_rng(0)
    evaluation = {"records": (_records("binary", rng.integers(0, 2, 40))
                              + _records("sampled", rng.integers(0, 5, 30), n=4)
                              + _records("partial", rng.integers(0, 2, 25), reward=rng.random(25)))}
    result = compare(evaluation, evaluation)
    assert [d.domain for d in result.domains] == ["binary", "partial", "sampled"]
    assert [d.pass_at_1.test for d in result.domains] == ["mcnemar", "mcnemar", "permutation"]
    for d in result.domains:
        assert d.verdict == "no change" and d.pass_at_1.diff == 0.0 and d.pass_at_1.ci == (0.0, 0.0)
        assert d.wins == d.losses == 0
    assert result.domains[1].partial_credit and result.domains[1].mean_reward.verdict == "no change"
    assert result.domains[0].mean_reward.verdict is None  # 0/1 rewards: pass@1 decides


def test_planted_regression_and_holm_across_domains():
    b1, c1 = _paired("gcd", both=0, neither=24, losses=6, wins=0)  # p = 0.03125 alone
    alone = compare(b1, c1).domains[0]
    assert alone.verdict == "regressed" and alone.losses == 6 and alone.pass_at_1.diff == pytest.approx(-0.2)
    assert alone.pass_at_1.ci[1] < 0
    b2, c2 = _paired("count", both=10, neither=14, losses=0, wins=6)  # p = 0.03125, improved
    b3, c3 = _paired("sum", both=20, neither=0, losses=5, wins=5)      # p = 1
    both = compare(b1 + b2 + b3, c1 + c2 + c3)
    by_name = {d.domain: d for d in both.domains}
    # Holm over 3: 0.03125 * 3 = 0.094 -> neither survives; the raw p-values are unchanged
    assert by_name["gcd"].pass_at_1.p == pytest.approx(0.03125)
    assert by_name["gcd"].pass_at_1.p_holm == pytest.approx(0.09375) and by_name["gcd"].verdict == "no change"
    assert by_name["count"].verdict == "no change" and by_name["sum"].verdict == "no change"
    b4, c4 = _paired("gcd", both=0, neither=10, losses=20, wins=0)
    strong = {d.domain: d for d in compare(b4 + b2, c4 + c2).domains}
    assert strong["gcd"].verdict == "regressed"  # 2 * 2^-19 survives Holm
    assert strong["count"].verdict == "improved"  # then 0.03125 * 1 < 0.05 at Holm's second step


def test_sampled_and_partial_credit_domains():
    rng = np.random.default_rng(1)
    base = _records("sampled", rng.integers(0, 3, 40), n=8)
    cand = _records("sampled", rng.integers(5, 9, 40), n=8)
    d = compare(base, cand, n_resamples=1999).domains[0]
    assert d.pass_at_1.test == "permutation" and d.verdict == "improved" and d.pass_at_1.p < 0.01
    rb = rng.uniform(0.2, 0.6, 50)
    pb = _records("partial", np.zeros(50), reward=rb)
    pc = _records("partial", np.zeros(50), reward=rb - 0.15 + rng.normal(0, 0.05, 50))
    d = compare(pb, pc, n_resamples=1999).domains[0]
    assert d.partial_credit and d.verdict == "no change"  # nobody reaches reward 1
    assert d.mean_reward.verdict == "regressed" and d.mean_reward.ci[1] < 0


def test_min_detectable_effect_formula():
    diff = np.array([-1.0] * 5 + [0.0] * 25)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert compare_lib.min_detectable_effect(diff) == pytest.approx(z * np.std(diff, ddof=1) / np.sqrt(30))
    assert compare_lib.min_detectable_effect(np.zeros(100)) == pytest.approx(z / 100)  # floor: one discordant pair
    z3 = stats.norm.ppf(1 - 0.05 / 6) + stats.norm.ppf(0.8)
    assert compare_lib.min_detectable_effect(diff, tests=3) == pytest.approx(z3 * np.std(diff, ddof=1) / np.sqrt(30))
    with pytest.raises(ValueError):
        compare_lib.min_detectable_effect([])


def test_refuses_different_task_sets_and_hashes():
    base, cand = _paired("gcd", both=5, neither=5, losses=1, wins=1)
    with pytest.raises(ValueError, match="task sets differ: 1 .* only in the baseline"):
        compare(base, cand[:-1])
    changed = [dict(r, prompt=r["prompt"] + "!") if r["task_id"] == 0 else r for r in cand]
    with pytest.raises(ValueError, match="hashes differ"):
        compare(base, changed)
    with pytest.raises(ValueError, match="does not match"):
        compare({"records": base, "task_set_hash": "0" * 64}, cand)
    bare = [{k: v for k, v in r.items() if k != "prompt"} for r in base]
    with pytest.raises(ValueError, match="no task_set_hash"):
        compare(bare, cand)
    ok = compare({"records": bare, "task_set_hash": task_set_hash(base)}, cand)
    assert ok.task_set_hash == task_set_hash(cand)
    with pytest.raises(ValueError, match="no records"):
        compare([], cand)


def test_same_seed_same_result():
    rng = np.random.default_rng(3)
    base = _records("d", rng.integers(0, 2, 60))
    cand = _records("d", rng.integers(0, 2, 60))
    assert compare(base, cand, seed=7) == compare(base, cand, seed=7)


def test_family_wise_intervals_agree_with_holm_where_the_unadjusted_ones_do_not():
    """Three domains of 7 wins and 1 loss in 40 tasks each: McNemar p = 0.07 each, so Holm says no change, yet each
    unadjusted 95% interval excludes 0 (what the forest plot drew). The family-wise interval (confidence 1 - alpha/3)
    contains 0 for each, and is wider than the unadjusted one."""
    base, cand = [], []
    for name in ("a", "b", "c"):
        b, c = _paired(name, both=16, neither=16, losses=1, wins=7)
        base, cand = base + b, cand + c
    h = task_set_hash(base)
    result = compare({"records": base, "task_set_hash": h}, {"records": cand, "task_set_hash": h}, n_resamples=2999)
    for d in result.domains:
        m = d.pass_at_1
        assert m.verdict == "no change" and m.p_holm > 0.05
        assert m.ci[0] > 0  # the unadjusted interval alone would call it an improvement
        assert m.ci_adjusted[0] <= 0 <= m.ci_adjusted[1]
        assert m.ci_adjusted[0] < m.ci[0] and m.ci_adjusted[1] >= m.ci[1]
        assert d.mean_reward.ci_adjusted is None  # binary rewards: mean_reward decides nothing
