"""The run plan's off-policy rule (`runs.plan.off_policy_defaults`, issue 24 item 2): at rollout.max_staleness > 0 the loss is
PPO-clip on the decoupled ratio with TIS on (rl.tis_cap -1 -> OFF_POLICY_TIS_CAP); an explicit choice wins, with a
warning when it leaves the lag uncorrected; at 0 nothing changes (TIS off); bad values are one error."""
import pytest

from helpers import tiny_config
from posttrain.config import ConfigError
from posttrain.config.plan import OFF_POLICY_TIS_CAP
from posttrain.config.plan import make_run_plan


@pytest.mark.parametrize("over,tis,warned", [
    ({}, None, None),  # the defaults: synchronous, TIS off, config.json records 0.0 as before the queue
    ({"rollout.max_staleness": 1}, OFF_POLICY_TIS_CAP, None),
    ({"rollout.max_staleness": 2, "rl.tis_cap": 5.0}, 5.0, None),  # the user's cap wins
    ({"rollout.max_staleness": 1, "rl.tis_cap": 0.0}, None, "without importance correction"),
    ({"rollout.max_staleness": 1, "rl.loss": "gspo"}, OFF_POLICY_TIS_CAP, "rl.loss='gspo'"),
    ({"rl.tis_cap": 3.0}, 3.0, None),
])
def test_the_off_policy_rule(over, tis, warned):
    plan = make_run_plan(tiny_config("/tmp/off-policy", **over))
    assert plan.step.loss.tis_cap == tis
    assert plan.step.loss.policy_loss == over.get("rl.loss", "ppo")
    assert plan.config.rollout.max_staleness == over.get("rollout.max_staleness", 0)
    assert plan.config_dict["rl"]["tis_cap"] == (tis or 0.0)  # the value used, not -1
    found = [w for w in plan.warnings if "rollout.max_staleness" in w]
    assert len(found) == int(warned is not None) and all(warned in w for w in found)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_max_staleness_is_one_error_naming_it(value):
    with pytest.raises((ConfigError, TypeError), match=r"max_staleness"):  # 1.5: ml_collections' int field
        tiny_config("/tmp/off-policy", **{"rollout.max_staleness": value})
