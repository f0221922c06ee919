"""A one-turn gymnasium env whose task's "mode" says what its reset / step does: the user-written env of the
rollout's fault tests (`test_episodes.py`), importable in env workers as FAULTY ("faulty_envs:test/Faulty-v0").

Modes: "reset" / "step" raise there; a key of RESETS is what reset returns (refused by `envs.base.checked_reset`);
every other mode is a key of RESULTS, the step's return value as it is;
REFUSED holds the reason `rollout.env_results.check_result` gives each refused mode, ACCEPTED what it makes of the
others.
"""
import gymnasium
import numpy as np

from envs.verify.answers import STATUSES

FAULTY = "faulty_envs:test/Faulty-v0"


def _step(reward, status="wrong", obs="", terminated=True):
    return (obs, reward, terminated, False, {"status": status})


RESULTS = {
    # accepted (real numbers within env.max_abs_reward, known statuses)
    "ok": _step(1.0, "ok"), "int": _step(1, "ok"), "bool": _step(True, "ok"), "np_float": _step(np.float32(0.5)),
    "np_bool": _step(np.bool_(False)), "bound": _step(1e4, "ok"), "-bound": _step(-1e4),
    "env_infra": ("", float("nan"), True, False, {"status": "infra_error", "reason": "flaky sandbox"}),
    # refused: rewards that are no real number, non-finite or too large
    "text": _step("1.0"), "none": _step(None), "list": _step([1.0]), "complex": _step(1 + 0j),
    "bytes": _step(b"1"), "array": _step(np.array(1.0)), "nan": _step(float("nan")), "inf": _step(float("inf")),
    "-inf": _step(float("-inf")), "huge": _step(1e30), "-huge": _step(-1e5),
    # refused: statuses, info, result shape, observation
    "banana": _step(0.0, "banana"), "truncated_status": _step(0.0, "truncated"), "empty_status": _step(0.0, ""),
    "no_status": ("", 1.0, True, False, {}), "info_list": ("", 1.0, True, False, [("status", "ok")]),
    "four": ("", 1.0, True, {"status": "ok"}), "obs_none": _step(0.0, "ok", obs=None, terminated=False),
}

NUMBER = "a reward must be a real number (int, float, bool or a numpy number)"
REFUSED = {  # mode -> info["reason"] (after "env '<id>' ")
    "text": f"returned reward '1.0' of type str; {NUMBER}",
    "none": f"returned reward None of type NoneType; {NUMBER}",
    "list": f"returned reward [1.0] of type list; {NUMBER}",
    "complex": f"returned reward (1+0j) of type complex; {NUMBER}",
    "bytes": f"returned reward b'1' of type bytes; {NUMBER}",
    "array": f"returned reward array(1.) of type ndarray; {NUMBER}",
    "nan": "returned a non-finite reward nan",
    "inf": "returned a non-finite reward inf",
    "-inf": "returned a non-finite reward -inf",
    "huge": "returned reward 1e+30, beyond env.max_abs_reward=10000 (a reward scale bug? rescale the env's rewards "
            "or raise env.max_abs_reward)",
    "-huge": "returned reward -100000.0, beyond env.max_abs_reward=10000 (a reward scale bug? rescale the env's "
             "rewards or raise env.max_abs_reward)",
    "banana": f"returned status 'banana'; expected one of {STATUSES}",
    "truncated_status": f"returned status 'truncated'; expected one of {STATUSES}",
    "empty_status": f"returned status ''; expected one of {STATUSES}",
    "no_status": f"returned no info['status'] on the step that ends the episode; expected one of {STATUSES}",
    "info_list": "returned info of type list ([('status', 'ok')]); expected a dict",
    "four": "returned a step result of 4 items; expected gymnasium's 5 (obs, reward, terminated, truncated, info)",
    "obs_none": "returned observation None of type NoneType for a next turn; expected a str",
}
ACCEPTED = {  # mode -> (reward, status, terminated)
    "ok": (1.0, "ok", True), "int": (1.0, "ok", True), "bool": (1.0, "ok", True), "np_float": (0.5, "wrong", True),
    "np_bool": (0.0, "wrong", True), "bound": (1e4, "ok", True), "-bound": (-1e4, "wrong", True),
}


RESETS = {  # mode -> what reset returns instead of (f"mode {mode}", {}), and the TypeError it gives
    "reset_obs_none": ((None, {}), "reset returned an observation of type NoneType ((None, {})); expected a str (the "
                       "first user message)"),
    "reset_obs_list": ((["hi"], {}), "reset returned an observation of type list ((['hi'], {})); expected a str (the "
                       "first user message)"),
    "reset_info_list": (("hi", []), "reset returned info of type list (('hi', [])); expected a dict"),
    "reset_bare_obs": ("hi", "reset returned 'hi'; expected gymnasium's (observation, info) pair"),
}


class FaultyEnv(gymnasium.Env):
    action_space = observation_space = gymnasium.spaces.Text(1000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.mode = options["task"]["mode"]
        if self.mode == "reset":
            raise RuntimeError("sandbox failed to start")
        if self.mode in RESETS:
            return RESETS[self.mode][0]
        return f"mode {self.mode}", {}

    def step(self, action):
        if self.mode == "step":
            raise RuntimeError("harness crashed")
        return RESULTS[self.mode]


if "test/Faulty-v0" not in gymnasium.registry:
    gymnasium.register("test/Faulty-v0", entry_point=FaultyEnv, disable_env_checker=True)
