"""`rollout.env_results.check_result`: an env step's result is checked where it becomes a sample; whatever a user's
env returns that is no valid reward, status, info or step tuple ends its episode as an infra_error naming the env,
what is wrong and the value (never scored, never coerced), and valid results pass with the reward as a float."""
import math

import pytest

from faulty_envs import ACCEPTED, FAULTY, NUMBER, REFUSED, RESULTS
from posttrain.rollout.env_results import DEFAULT_MAX_ABS_REWARD, check_result

def test_every_mode_of_the_faulty_env_is_covered():
    assert set(RESULTS) == set(REFUSED) | set(ACCEPTED) | {"env_infra"}


@pytest.mark.parametrize("mode", sorted(REFUSED))
def test_a_malformed_result_ends_the_episode_as_an_infra_error_naming_the_env(mode):
    obs, reward, terminated, truncated, info = check_result(RESULTS[mode], FAULTY)
    assert (obs, reward, terminated, truncated) == ("", 0.0, False, True)
    assert info["status"] == "infra_error" and info["reason"] == f"env {FAULTY!r} {REFUSED[mode]}"


@pytest.mark.parametrize("mode", sorted(ACCEPTED))
def test_a_real_reward_within_the_bound_and_a_known_status_pass_as_a_float(mode):
    reward, status, terminated = ACCEPTED[mode]
    obs, got, term, trunc, info = check_result(RESULTS[mode], FAULTY)
    assert got == reward and type(got) is float and (term, trunc) == (terminated, False)
    assert info == {"status": status} and type(info) is dict and obs == ""


def test_an_infra_error_the_env_reports_keeps_its_reason_and_reads_no_reward():
    assert check_result(RESULTS["env_infra"], FAULTY) == ("", 0.0, True, True, {"status": "infra_error",
                                                                                 "reason": "flaky sandbox"})


def test_a_refused_result_keeps_the_envs_other_info():
    _, _, _, _, info = check_result(("", "1", True, False, {"status": "ok", "gold": "4", "turn": 1}), "my:E-v0")
    assert info == {"status": "infra_error", "gold": "4", "turn": 1,
                    "reason": f"env 'my:E-v0' returned reward '1' of type str; {NUMBER}"}


@pytest.mark.parametrize("result, why", [
    (None, "returned a step result of a NoneType"), ("abc", "returned a step result of a str"),
    (("", 1.0, True, False, {"status": "ok"}, "extra"), "returned a step result of 6 items"),
])
def test_a_result_that_is_no_step_tuple_is_named(result, why):
    _, _, _, _, info = check_result(result, "my:E-v0")
    assert info["status"] == "infra_error" and info["reason"].startswith(f"env 'my:E-v0' {why}; expected")


def test_the_bound_is_the_callers_and_inclusive():
    assert DEFAULT_MAX_ABS_REWARD == 1e4
    assert check_result(("", 10.0, True, False, {"status": "ok"}), "E", max_abs_reward=10.0)[1] == 10.0
    info = check_result(("", -10.5, True, False, {"status": "ok"}), "E", max_abs_reward=10.0)[4]
    assert info["reason"].startswith("env 'E' returned reward -10.5, beyond env.max_abs_reward=10 ")
    assert check_result(RESULTS["huge"], "E", max_abs_reward=math.inf)[1] == 1e30  # the API takes no bound
    assert check_result(RESULTS["inf"], "E", max_abs_reward=math.inf)[4]["status"] == "infra_error"  # never inf


def test_a_turn_that_goes_on_may_leave_the_status_out_but_not_give_an_unknown_one():
    obs, reward, terminated, truncated, info = check_result(("next question", 0.0, False, False, {"turn": 1}), "x")
    assert (obs, reward, terminated, truncated, info) == ("next question", 0.0, False, False, {"turn": 1})
    refused = check_result(("next question", 0.0, False, False, {"status": "banana"}), "x")
    assert refused[4]["status"] == "infra_error" and "returned status 'banana'" in refused[4]["reason"]
    ended = check_result(("", 1.0, True, False, {}), "x")
    assert ended[4]["reason"].startswith("env 'x' returned no info['status'] on the step that ends the episode")
