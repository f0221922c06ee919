"""`posttrain.eval.power`: seed pairs split from one pool of samples, A/A false alarms recounted with
`scipy.stats.binomtest` on the discordant pairs (one domain: Holm is the identity), a planted constant reply
rescored and detected, and the pool's errors."""
import numpy as np
import pytest
from scipy import stats

from posttrain.eval import power

SEEDS, TASKS = 10, 120


def _pool(rng, domain="d", tasks=TASKS, n=2 * SEEDS, p_low=0.3, p_high=0.95):
    """A pool of `tasks` tasks, each solved with its own probability in [p_low, p_high], n samples each."""
    out = []
    for i, p in enumerate(rng.uniform(p_low, p_high, tasks)):
        correct = (rng.random(n) < p).tolist()
        out.append({"domain": domain, "area": "a", "task_id": i, "index": i, "prompt": f"{domain} {i}",
                    "replies": ["right" if c else "wrong" for c in correct], "statuses": ["ok"] * n,
                    "rewards": [float(c) for c in correct], "correct": correct, "formatted": [True] * n,
                    "lengths": [3] * n, "truncated": [False] * n, "greedy": False, "gold": "right"})
    return out


def _rescore(records):
    """The fake env: a reply solves its task when it is "right"."""
    return [{**r, "correct": [x == "right" for x in r["replies"]],
             "rewards": [float(x == "right") for x in r["replies"]]} for r in records]


def test_split_sample_cuts_every_per_sample_field_and_plant_replaces_one_domain():
    pool = _pool(np.random.default_rng(0), tasks=3, n=4) + _pool(np.random.default_rng(1), "e", tasks=2, n=4)
    one = power.split_sample(pool, 3)
    assert all(len(r[k]) == 1 for r in one for k in ("replies", "rewards", "correct", "lengths", "truncated"))
    assert [r["correct"][0] for r in one] == [r["correct"][3] for r in pool] and not any(r["greedy"] for r in one)
    planted = power.plant(pool, "e", "nope")
    assert all(r["replies"] == ["nope"] * 4 for r in planted if r["domain"] == "e")
    assert [r["replies"] for r in planted if r["domain"] == "d"] == [r["replies"] for r in pool if r["domain"] == "d"]


def test_aa_false_alarms_match_binomtest_on_the_discordant_pairs_and_the_plant_is_detected():
    pool = _pool(np.random.default_rng(7))
    got = power.measure(pool, seeds=SEEDS, alpha=0.05, planted_domain="d", planted_reply="wrong", rescore=_rescore)
    correct_TxN = np.array([r["correct"] for r in pool])
    want = []
    for s in range(SEEDS):
        a, b = correct_TxN[:, 2 * s], correct_TxN[:, 2 * s + 1]
        wins, losses = int(np.sum(b & ~a)), int(np.sum(a & ~b))
        p = stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
        want.append(p < 0.05)
        assert got.aa_pass_at_1["d"][s] == pytest.approx((b.sum() - a.sum()) / TASKS)
    assert got.false_alarms["d"] == [s for s in range(SEEDS) if want[s]]
    assert got.false_alarm_rate == pytest.approx(sum(want) / SEEDS) and got.false_alarm_rate <= 0.1
    assert got.detected == list(range(SEEDS)) and got.detection_rate == 1.0  # pass@1 ~0.6 -> 0: always regressed
    assert got.planted_pass_at_1 == [0.0] * SEEDS


def test_two_domains_count_domain_x_seed_pairs_and_a_harmless_plant_is_not_detected():
    pool = _pool(np.random.default_rng(3), "d", tasks=40, n=6) + _pool(np.random.default_rng(4), "e", tasks=40, n=6)
    got = power.measure(pool, seeds=3, planted_domain="e", planted_reply="right", rescore=_rescore)
    assert got.domains == ("d", "e") and len(got.aa_pass_at_1["e"]) == 3
    assert got.false_alarm_rate == pytest.approx(sum(map(len, got.false_alarms.values())) / 6)
    assert got.detected == [] and got.planted_pass_at_1 == [1.0] * 3  # every reply right: improved, not regressed


@pytest.mark.parametrize("kwargs, message", [
    ({"seeds": 11}, "need >= 22 samples per task; the pool has 20"),
    ({"seeds": 2, "planted_domain": "zzz", "rescore": _rescore}, "planted_domain='zzz'"),
    ({"seeds": 2, "planted_domain": "d"}, "with a rescore function"),
])
def test_bad_measurements_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        power.measure(_pool(np.random.default_rng(0), tasks=4), **kwargs)


def test_a_pool_with_unequal_samples_is_refused():
    pool = _pool(np.random.default_rng(0), tasks=2, n=4)
    pool[1] = {**pool[1], "replies": pool[1]["replies"][:2]}
    with pytest.raises(ValueError, match=r"got \[2, 4\]"):
        power.pool_size(pool)


def test_the_power_script_measures_a_written_pool(tmp_path, capsys):
    """scripts/eval_power.py --pool (no model): a pool of 6 samples per task on 12 real arithmetic tasks from a
    scripted sampler (sample g of task i right unless (i + g) % 3 == 0), written as the script writes it; A/A over
    3 seed pairs, the planted constant rescored through the arithmetic env and detected in every seed."""
    import importlib.util
    import json
    import pathlib

    from posttrain.eval import records as records_lib, runner, suite as suite_lib
    from posttrain.eval.metrics import task_set_hash
    from posttrain.rollout.episodes import InlineEnvs
    from test_eval_runner import TOK, answer, scripted

    root = pathlib.Path(__file__).resolve().parents[3]
    suite = suite_lib.parse_suite({"name": "p", "areas": {"arithmetic": {"trained": True, "domains": {"arithmetic": {
        "env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}, "scorer": "last_integer",
        "format": "number", "tasks": 12, "temperature": 1.0, "n": 6}}}}})
    built, skipped = suite_lib.resolve(suite)
    r = built[0]
    index = {}
    episodes = [runner.Episode(r.spec.id, dict(r.spec.kwargs), r.source.get_task(i), seed=i, domain="arithmetic")
                for i in range(r.num_tasks)]
    fn = scripted(lambda p, g: f"{answer(p) + int((index.setdefault(p, len(index)) + g) % 3 == 0)}")
    pool = runner.sample_domain(fn, TOK, InlineEnvs(), episodes, batch_size=72, num_samples=6, scorer="last_integer",
                                fmt="number", greedy=False, area="arithmetic")
    results = {"label": "scripted", "step": 0, "task_set_hash": task_set_hash(pool), "temperature": 1.0,
               "suite": suite_lib.suite_dict(suite, built, skipped)}
    records_lib.write_evaluation(tmp_path / "pool", pool, results)
    spec = importlib.util.spec_from_file_location("eval_power", root / "scripts/eval_power.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main([f"--pool={tmp_path / 'pool'}", "--seeds=3", "--json"])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == out and "A/A false-alarm rate" in printed
    assert out["tasks"] == {"arithmetic": 12} and out["samples_per_task"] == 6
    assert out["pool_pass_at_1"]["arithmetic"] == pytest.approx(2 / 3)
    assert out["planted_domain"] == "arithmetic" and out["detected"] == [0, 1, 2] and out["detection_rate"] == 1.0
    assert out["planted_pass_at_1"] == [0.0] * 3
    assert out["false_alarm_rate"] == pytest.approx(len(out["false_alarms"]["arithmetic"]) / 3)
