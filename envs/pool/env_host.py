"""EnvPool worker side: the environments of many episodes in one process (no JAX here, ever).

`EnvHost` holds one env per live episode and reuses finished ones; it runs in a subprocess started as
``python -m envs.pool.env_host FD [MODULE...]`` (process backend) or in a Ray actor. Protocol: docs/pool.md.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import gymnasium

from envs.base import as_reward, checked_reset


class EnvHost:
    """Environments of the episodes assigned to one worker, keyed by episode index."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[tuple, gymnasium.Env]] = {}
        self._free: dict[tuple, list[gymnasium.Env]] = defaultdict(list)

    def _reset(self, episode: int, env_id: str, env_kwargs: dict, task: Any, seed: int | None):
        self.release(episode)
        key = (env_id, repr(sorted(env_kwargs.items())))
        env = self._free[key].pop() if self._free[key] else gymnasium.make(env_id, **env_kwargs)
        self._live[episode] = (key, env)
        return checked_reset(env.reset(seed=seed, options=None if task is None else {"task": task}), env_id)

    def _step(self, episode: int, action: str):
        """The env's step tuple, its reward a float when a real number (`envs.base.as_reward`), its info a dict.

        A reward or info of another kind is returned as the env gave it, for the pool's caller to refuse.
        """
        if episode not in self._live:
            raise KeyError(f"episode {episode} is not active in this worker (reset it first)")
        obs, reward, terminated, truncated, info = self._live[episode][1].step(action)
        if terminated or truncated:
            self.release(episode)
        value = as_reward(reward)
        info = dict(info) if isinstance(info, Mapping) else info
        return obs, reward if value is None else value, bool(terminated), bool(truncated), info

    def handle(self, op: str, item: tuple) -> tuple[str, Any]:
        """Run one reset/step item; ("ok", result) or ("error", reason). Never raises."""
        try:
            if op == "reset":
                return "ok", self._reset(*item)
            if op == "step":
                return "ok", self._step(*item)
            raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # an env bug: the episode ends as infra_error, the worker lives on
            self._live.pop(item[0], None)  # the env may be in a bad state: do not reuse it
            tb = traceback.format_exception(type(e), e, e.__traceback__, limit=-3)
            return "error", f"{op} raised {type(e).__name__}: {e}\n{''.join(tb)[-2000:]}"

    def release(self, episode: int) -> None:
        """Return the episode's env to the free list (reused by a later reset with the same key)."""
        if episode in self._live:
            key, env = self._live.pop(episode)
            self._free[key].append(env)

    def release_all(self) -> None:
        """Release every episode (a new reset batch replaces all earlier episodes)."""
        for episode in list(self._live):
            self.release(episode)

    def close(self) -> None:
        for env in [e for _, e in self._live.values()] + [e for es in self._free.values() for e in es]:
            try:
                env.close()
            except Exception:
                pass
        self._live.clear(), self._free.clear()


def worker_info() -> dict:
    return {"pid": os.getpid(), "jax_imported": "jax" in sys.modules}


def _exit_when_orphaned(parent: int) -> None:
    """Watchdog: a worker whose pool process died exits, even if an env step hangs."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[1]))
    for module in argv[2:]:
        importlib.import_module(module)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    host = EnvHost()
    conn.send(("ready", worker_info()))
    try:
        while True:
            try:
                op, items = conn.recv()
            except EOFError:
                break
            if op == "close":
                break
            if op in ("reset", "release"):
                host.release_all()
            for item in items:
                kind, payload = host.handle(op, item)
                try:
                    conn.send(("result", item[0], kind, payload))
                except Exception as e:  # e.g. an info dict that does not pickle
                    conn.send(("result", item[0], "error", f"result could not be sent: {type(e).__name__}: {e}"))
    finally:
        host.close()


if __name__ == "__main__":
    main(sys.argv)
