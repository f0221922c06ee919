"""Ray backend of `envs.pool.processes.EnvPool` (``EnvPool(..., backend="ray")``): one Ray actor per worker.

Needs the optional extra (``pip install posttrain[ray]``); ray is imported only when this backend is
used. Uses the current Ray cluster (``ray.init(...)`` first; otherwise Ray starts a local one on the
first actor). Each actor holds an `envs.pool.worker.EnvHost`; items are submitted as one actor call
each, so Ray runs them in order and the pool sees each result as it lands (per-item timeouts as with
the process backend). A hung actor is killed with ``ray.kill``; a dead one (``RayActorError``, e.g.
``ActorDiedError``) is replaced; the pool turns both into infra_error episodes.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.pool.worker import EnvHost, worker_info


def import_ray(user: str = "EnvPool(backend='ray')"):
    """The `ray` module; ImportError naming `user` and the install command when it is missing."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{user} needs ray: pip install 'posttrain[ray]' (or `pip install ray`)") from e
    return ray


class EnvActor:
    """The Ray actor: imports the registration modules, then serves reset/step items."""

    def __init__(self, imports: Sequence[str], sys_path: Sequence[str]) -> None:
        sys.path[:0] = [p for p in sys_path if p not in sys.path]  # import what the driver can import
        for module in imports:
            importlib.import_module(module)
        self._host = EnvHost()

    def ready(self) -> dict:
        return worker_info()

    def handle(self, op: str, item: tuple) -> tuple[str, Any]:
        return self._host.handle(op, item)

    def release_all(self) -> None:
        self._host.release_all()


class RayWorkers:
    """Same interface as `envs.pool.processes.ProcessWorkers`: start/send/poll/kill/pids/close."""

    def __init__(self, num_workers: int, imports: Sequence[str], actor_options: Mapping[str, Any] | None) -> None:
        self._ray = import_ray()
        options = dict(actor_options) if actor_options is not None else {"num_cpus": 0}
        self._cls = self._ray.remote(**options)(EnvActor)
        self._imports = list(imports)
        self._actors: list[Any] = [None] * num_workers
        self._pids: list[int | None] = [None] * num_workers
        self._refs: dict[Any, tuple[int, Any]] = {}  # ObjectRef -> (worker, "ready" | episode), in order
        for w in range(num_workers):
            self.start(w)

    def start(self, w: int) -> None:
        self._actors[w] = self._cls.remote(self._imports, [p or os.getcwd() for p in sys.path])
        self._refs[self._actors[w].ready.remote()] = (w, "ready")

    def send(self, w: int, op: str, items: list) -> None:
        if op in ("reset", "release"):  # calls on one actor run in order: this one comes first
            self._actors[w].release_all.remote()
        for item in items:
            self._refs[self._actors[w].handle.remote(op, item)] = (w, item[0])

    def poll(self, timeout_s: float) -> list[tuple[int, tuple]]:
        """Events (worker, ("ready", info) | ("result", ep, kind, payload) | ("died", reason))."""
        ray = self._ray
        if not self._refs:
            time.sleep(max(0.0, min(timeout_s, 0.05)))
            return []
        refs = list(self._refs)
        ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, timeout_s))
        if ready:
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        events = []
        for ref in [r for r in refs if r in ready]:  # submission order
            if ref not in self._refs:  # its worker died earlier in this loop
                continue
            w, tag = self._refs.pop(ref)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as e:
                events.append((w, ("died", f"ray actor died ({type(e).__name__}: {str(e)[:200]})")))
                self._forget(w)
                continue
            if tag == "ready":
                self._pids[w] = value["pid"]
                events.append((w, ("ready", value)))
            else:
                events.append((w, ("result", tag, *value)))
        return events

    def _forget(self, w: int) -> None:
        for ref in [r for r, (worker, _) in self._refs.items() if worker == w]:
            del self._refs[ref]

    def kill(self, w: int) -> None:
        if self._actors[w] is not None:
            self._ray.kill(self._actors[w], no_restart=True)
        self._forget(w)
        self._actors[w] = self._pids[w] = None

    def pids(self) -> list[int | None]:
        return list(self._pids)

    def close(self) -> None:
        for w in range(len(self._actors)):
            self.kill(w)
