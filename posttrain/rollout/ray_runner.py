"""RayEnvRunner: the rollout phase's `episodes.EnvRunner` on Ray actors, so the job scheduler's tickets and reports
drive envs spread over a Ray cluster exactly as they drive the in-process runner or the worker pool.

    ray.init(...)                                   # the cluster (or a local one)
    runner = RayEnvRunner(num_actors=8, max_restarts=3, step_timeout_s=60, imports=("envs", "my.envs"))
    first = runner.reset(episodes)                  # [(observation, info)], episode i on actor i % num_actors
    results = runner.step(replies, indices)         # [(observation, reward, terminated, truncated, info)]

Each actor holds env instances (one per (env id, kwargs, episode slot), reused across resets). Worker death is
Ray's restart: actors are created with `max_restarts` (Ray restarts a dead actor process: crash, OOM kill, lost
node) and `max_task_retries=0` (Ray never re-runs a call in flight when its actor died, so no env step runs twice).
Every episode the dead actor held ends with `info["status"] == "infra_error"` (reward 0, truncated; `reason` names
the Ray error): the one in flight at once, the others at their next step (their env state died with the actor).
The job scheduler then retries that sample in the step (`tasks.retry`: a new attempt, archived as its own row), on
whichever actor the retry ticket lands; nothing is ever scored 0 for it (docs/design.md invariant 6). A call that
exceeds `step_timeout_s` gets its actor killed (Ray restarts it) and ends the same way. The next call waits until
Ray's restart is done (a call to a restarting actor would fail at once); an actor whose restarts are spent, or that
does not come back within step_timeout_s, is replaced by a new one (`replaced`). Counters: `infra_errors`, `deaths`,
`replaced`.
Needs the optional extra (`pip install 'posttrain[ray]'`); ray is imported only when a RayEnvRunner is built.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.pool.ray_pool import import_ray


def _infra(reason: str) -> dict:
    return {"status": "infra_error", "reason": reason}


class EnvHostActor:
    """The Ray actor: imports the registration modules, builds and keeps envs, resets and steps episodes by slot."""

    def __init__(self, imports: Sequence[str], sys_path: Sequence[str]):
        sys.path[:0] = [p for p in sys_path if p not in sys.path]  # import what the driver can import
        for module in imports:
            importlib.import_module(module)
        import gymnasium

        self._make = gymnasium.make
        self._envs: dict[tuple, Any] = {}
        self._active: dict[int, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def reset(self, slot: int, env_id: str, kwargs: Mapping, task, seed) -> tuple[str, dict]:
        self._active.pop(slot, None)
        key = (env_id, json.dumps(dict(kwargs), sort_keys=True, default=str), slot)
        try:
            if key not in self._envs:
                self._envs[key] = self._make(env_id, **dict(kwargs)).unwrapped
            obs, info = self._envs[key].reset(seed=seed, options={"task": task})
        except Exception as e:  # noqa: BLE001 - an env that cannot start is this episode's infra error
            return "", _infra(f"env reset raised {type(e).__name__}: {e}")
        self._active[slot] = self._envs[key]
        return obs, dict(info)

    def step(self, slot: int, action: str) -> tuple:
        env = self._active.get(slot)
        if env is None:
            return "", 0.0, False, True, _infra("the episode's env state was lost (its Ray actor restarted)")
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception as e:  # noqa: BLE001 - an env bug ends this episode, not the run
            self._active.pop(slot, None)
            return "", 0.0, False, True, _infra(f"env step raised {type(e).__name__}: {e}")
        return obs, float(reward), bool(terminated), bool(truncated), dict(info)


class RayEnvRunner:
    """An `EnvRunner` over `num_actors` Ray actors (module docstring).

    Args:
      num_actors: actors (>= 1); episode i of a reset lives on actor i % num_actors.
      max_restarts: Ray restarts of a dead actor before it is replaced by a new one (>= 0).
      step_timeout_s: seconds one reset or step call may take on its actor, counted from its actor's previous
        call of the batch (> 0).
      imports: modules each actor imports first (env registrations; the driver's sys.path is searched).
      actor_options: more `ray.remote` options (default num_cpus=0); max_restarts and max_task_retries are ours.
    Raises ValueError for bad arguments; ImportError without ray. Uses the current Ray cluster (ray.init first;
    otherwise Ray starts a local one).
    """

    def __init__(self, num_actors: int = 2, *, max_restarts: int = 3, step_timeout_s: float = 60.0,
                 imports: Sequence[str] = ("envs",), actor_options: Mapping[str, Any] | None = None):
        checks = (("num_actors", num_actors, isinstance(num_actors, int) and num_actors >= 1),
                  ("max_restarts", max_restarts, isinstance(max_restarts, int) and max_restarts >= 0),
                  ("step_timeout_s", step_timeout_s, step_timeout_s > 0))
        bad = {k: v for k, v, ok in checks if not ok}
        if bad:
            raise ValueError(f"RayEnvRunner: needs num_actors >= 1, max_restarts >= 0, step_timeout_s > 0; got {bad}")
        self._ray = ray = import_ray("RayEnvRunner")
        options = {"num_cpus": 0, **dict(actor_options or {}), "max_restarts": max_restarts, "max_task_retries": 0}
        self._cls = ray.remote(**options)(EnvHostActor)
        self._imports, self.max_restarts, self.step_timeout_s = list(imports), max_restarts, float(step_timeout_s)
        self._actors = [self._new_actor() for _ in range(num_actors)]
        self._restarting: set[int] = set()  # actors that died since the last call: Ray is restarting them
        self._lost: dict[int, tuple] = {}
        self._n = 0
        self.infra_errors = self.deaths = self.replaced = 0

    def _new_actor(self):
        return self._cls.remote(self._imports, [p or os.getcwd() for p in sys.path])

    def reset(self, episodes: Sequence[Any]) -> list[tuple[str, dict]]:
        """Resets episodes (objects with env_id, env_kwargs, task, seed); an episode whose actor died or whose env
        failed to start gets ("", infra_error info) and its next step returns that infra error."""
        self._await_restarts()
        self._lost, self._n = {}, len(episodes)
        refs = [self._actors[i % len(self._actors)].reset.remote(i, ep.env_id, dict(ep.env_kwargs), ep.task, ep.seed)
                for i, ep in enumerate(episodes)]
        out = []
        for i, value in enumerate(self._gather(refs, list(range(len(episodes))))):
            if isinstance(value, str):
                self._lost[i] = ("", 0.0, False, True, _infra(value))
                value = ("", _infra(value))
            elif value[1].get("status") == "infra_error":
                self._lost[i] = ("", 0.0, False, True, value[1])
            out.append(tuple(value))
        return out

    def step(self, actions: Sequence[str], indices: Sequence[int] | None = None) -> list[tuple]:
        """Steps episodes `indices` (default: all of the last reset) with one action each; results in that order.
        Raises ValueError for a length mismatch or an index outside the last reset."""
        indices = list(range(self._n)) if indices is None else [int(i) for i in indices]
        if len(actions) != len(indices):
            raise ValueError(f"step got {len(actions)} actions for {len(indices)} episodes")
        outside = [i for i in indices if not 0 <= i < self._n]
        if outside:
            raise ValueError(f"step: episodes {outside} are not in the last reset of {self._n}")
        self._await_restarts()
        live = [(i, a) for i, a in zip(indices, actions) if i not in self._lost]
        refs = [self._actors[i % len(self._actors)].step.remote(i, a) for i, a in live]
        got = dict(zip([i for i, _ in live], self._gather(refs, [i for i, _ in live])))
        out = []
        for i in indices:
            value = self._lost.pop(i) if i in self._lost else got[i]
            out.append(("", 0.0, False, True, _infra(value)) if isinstance(value, str) else tuple(value))
        self.infra_errors += sum(r[4].get("status") == "infra_error" for r in out)
        return out

    def _gather(self, refs: list, episodes: list[int]) -> list:
        """Each call's value, or the reason (a str) it has none: its actor died or it timed out (actor killed)."""
        ray, n = self._ray, len(self._actors)
        done_at: dict[int, float] = {}
        dead: set[int] = set()
        start = time.monotonic()
        out = []
        for ref, ep in zip(refs, episodes):
            w = ep % n
            try:
                out.append(ray.get(ref, timeout=max(0.0, done_at.get(w, start) + self.step_timeout_s
                                                    - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                out.append(f"env call of episode {ep} took longer than {self.step_timeout_s:g} s: its Ray actor was "
                           "killed (Ray restarts it)")
                ray.kill(self._actors[w], no_restart=False)
                dead.add(w)
            except ray.exceptions.RayActorError as e:
                out.append(f"ray actor died ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
                dead.add(w)
            done_at[w] = time.monotonic()
        for w in sorted(dead):
            self._died(w)
        return out

    def _died(self, w: int) -> None:
        self.deaths += 1
        self._restarting.add(w)

    def _await_restarts(self) -> None:
        """Waits (up to step_timeout_s each) until every actor that died is back from Ray's restart, so no call
        lands on an actor that is still restarting; one that is dead for good (restarts spent) or does not come
        back in time is replaced by a new actor."""
        ray = self._ray
        for w in sorted(self._restarting):
            deadline = time.monotonic() + self.step_timeout_s
            while True:
                try:
                    ray.get(self._actors[w].pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass
                ray.kill(self._actors[w], no_restart=True)
                self._actors[w] = self._new_actor()
                self.replaced += 1
                break
        self._restarting.clear()

    def pids(self) -> list[int]:
        """The actors' process ids (a restarted actor has a new one)."""
        self._await_restarts()
        return self._ray.get([a.pid.remote() for a in self._actors], timeout=self.step_timeout_s)

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a, no_restart=True)
        self._actors = []
