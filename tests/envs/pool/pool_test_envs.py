"""Tiny gymnasium text envs for the EnvPool tests (imported in the pool's workers).

Echo-v0: the task is {"answer": str, "turns": int}; each step scores 1.0 when the action equals the
answer; the episode terminates after `turns` steps. Observations carry a number drawn from the
seeded np_random, so seeds are visible. Special actions misbehave on purpose: "sleep:<seconds>",
"crash" (the worker process exits), "raise" (the env raises), "pid" (the observation is the worker pid),
"reward:<Python literal>" (that value is the reward, as a user's env might return it: "reward:'1.0'", "reward:None").
"""
import ast
import os
import time

import gymnasium
from gymnasium.spaces import Text


class EchoEnv(gymnasium.Env):
    observation_space = Text(max_length=1000)
    action_space = Text(max_length=1000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._task = (options or {}).get("task") or {"answer": "a", "turns": 1}
        self._turn = 0
        return f"draw={int(self.np_random.integers(1 << 30))}", {"status": "ok"}

    def step(self, action):
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":")[1]))
        elif action == "crash":
            os._exit(3)
        elif action == "raise":
            raise RuntimeError("env bug")
        self._turn += 1
        reward = (ast.literal_eval(action.removeprefix("reward:")) if action.startswith("reward:")
                  else float(action == self._task["answer"]))
        obs = str(os.getpid()) if action == "pid" else f"turn={self._turn} draw={int(self.np_random.integers(1 << 30))}"
        done = self._turn >= self._task["turns"]
        return obs, reward, done, False, {"status": "ok" if reward else "wrong"}


if "posttrain-test/Echo-v0" not in gymnasium.registry:
    gymnasium.register("posttrain-test/Echo-v0", entry_point=EchoEnv, disable_env_checker=True)
