"""Training-side gaming floors (`rollout.floor_metrics`): reward/<domain>/above_floor = reward/<domain>/mean - the stored
floor, in every step's rollout metrics (`Rollouter.collect`), only for domains the registry has a floor for."""
import types

import numpy as np
import pytest

from posttrain.config import EnvSpec
from posttrain.rollout import floor_metrics, rollouter

COIN = EnvSpec(id="posttrain/ReasoningGym-v0", kwargs={"dataset": "coin_flip", "config": "{}", "split": "train"})


@pytest.mark.parametrize("metrics, table, want", [
    ({"reward/a/mean": 0.5}, {"a": 0.2}, {"reward/a/above_floor": 0.3}),
    ({"reward/a/mean": 0.1}, {"a": 0.95}, {"reward/a/above_floor": -0.85}),  # below the floor: negative
    ({"reward/a/mean": 0.5}, {"a": None}, {}),  # no floor known: no metric
    ({"reward/b/mean": 0.5}, {"a": 0.2}, {}),  # the domain is not in this batch
    ({"reward/a/mean": 1.0, "reward/b/mean": 0.0}, {"a": 0.0, "b": 0.5},
     {"reward/a/above_floor": 1.0, "reward/b/above_floor": -0.5}),
])
def test_above_floor_is_the_mean_reward_minus_the_floor(metrics, table, want):
    got = floor_metrics.above_floor_metrics(metrics, table)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v)


def test_spec_floors_read_the_stored_table():
    got = floor_metrics.spec_floors({"coin": COIN, "user": EnvSpec(id="user_module:Fake-v0"),
                              "no_dataset": EnvSpec(id="posttrain/ReasoningGym-v0", kwargs={"config": "{}"})})
    assert got["coin"] == pytest.approx(0.95)  # envs/tasks/domain_floors.json: <answer>0</answer> earns 0.95
    assert got["user"] is None and got["no_dataset"] is None


def test_collect_reports_reward_above_floor_per_domain(monkeypatch):
    """Two domains in one batch: coin_flip (floor 0.95) gets reward/coin/above_floor, a user env (no floor) none."""
    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.rollout.episodes import Sample

    rewards = {"coin": [1.0, 0.0, 1.0, 1.0], "user": [1.0, 0.0, 0.0, 0.0]}
    samples = [Sample(domain=d, group=g, prompt_ids=[1, 2], reward=r, status="ok", done=True,
                      segments=[(np.array([3, 4], np.int32), np.zeros(2, np.float32), True)])
               for g, (d, rs) in enumerate(rewards.items()) for r in rs]

    def fake_draw(self, step, sample_fn, key):
        return samples, {}, []

    monkeypatch.setattr(rollouter.Rollouter, "draw", fake_draw)
    monkeypatch.setattr(rollouter.Rollouter, "sample_fn", lambda self, policy, params: None)
    settings = types.SimpleNamespace(
        sampling_config=types.SimpleNamespace(params=lambda: None, prompt_bucket=16), scheduler=None, row_multiple=1,
        objective=types.SimpleNamespace(group_size=4, packed=False, overlong_filter=False))
    specs = {"coin": COIN, "user": EnvSpec(id="user_module:Fake-v0")}
    r = rollouter.Rollouter(settings=settings, mesh=None, graphdef=None,
                            tokenizer=types.SimpleNamespace(pad_id=0, decode=lambda ids, **kw: ""), runner=None,
                            scheduler=None, train_specs=specs, advantage_fn=advantage_fn("grpo"))
    m = r.collect(0, None, __import__("jax").random.key(0)).metrics
    assert m["reward/coin/mean"] == pytest.approx(0.75)
    assert m["reward/coin/above_floor"] == pytest.approx(0.75 - 0.95)
    assert m["reward/user/mean"] == pytest.approx(0.25) and "reward/user/above_floor" not in m
