"""Ray backend of `envs.pool.processes.EnvPool` (``backend="ray"``): one Ray actor per worker.

Needs the optional extra (``pip install posttrain[ray]``), imported only when used. A dead actor is Ray's restart
(``max_restarts``; a call in flight is never re-run); its episodes end as infra_error. Details: docs/pool.md.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.pool.env_host import EnvHost, worker_info

DEFAULT_ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": 3}
READY_RETRY_S = 0.05  # seconds between `ready` calls to an actor Ray is restarting


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
    """Same interface as `envs.pool.processes.ProcessWorkers`: start/send/poll/kill/pids/close.

    actor_options: `ray.remote` options over DEFAULT_ACTOR_OPTIONS; ``max_task_retries`` is always 0. Counter:
    `replaced` (actors created anew in a slot).
    """

    def __init__(self, num_workers: int, imports: Sequence[str], actor_options: Mapping[str, Any] | None) -> None:
        self._ray = import_ray()
        options = {**DEFAULT_ACTOR_OPTIONS, **dict(actor_options or {}), "max_task_retries": 0}
        self._cls = self._ray.remote(**options)(EnvActor)
        self._imports = list(imports)
        self._actors: list[Any] = [None] * num_workers
        self._pids: list[int | None] = [None] * num_workers
        self._ready = [False] * num_workers
        self._restarting: set[int] = set()  # workers whose actor died: Ray is restarting it
        self._ask_ready: dict[int, float] = {}  # worker -> when to call `ready` again (its actor was restarting)
        self._refs: dict[Any, tuple[int, Any]] = {}  # ObjectRef -> (worker, "ready" | episode), in order
        self._queued: list[list[tuple[str, list]]] = [[] for _ in range(num_workers)]  # sent before `ready`
        self.replaced = 0
        for w in range(num_workers):
            self.start(w)

    def start(self, w: int) -> None:
        """Starts worker w: a new actor, or the same one when Ray restarts it (its `ready` call waits for it)."""
        if self._actors[w] is None:
            self._actors[w] = self._cls.remote(self._imports, [p or os.getcwd() for p in sys.path])
        self._ready[w], self._pids[w] = False, None
        self._refs[self._actors[w].ready.remote()] = (w, "ready")

    def send(self, w: int, op: str, items: list) -> None:
        """Submit `items` to worker w's actor, or hold them, in order, until it has answered `ready`."""
        if not self._ready[w]:
            self._queued[w].append((op, items))
            return
        if op in ("reset", "release"):  # calls on one actor run in order: this one comes first
            self._actors[w].release_all.remote()
        for item in items:
            self._refs[self._actors[w].handle.remote(op, item)] = (w, item[0])

    def poll(self, timeout_s: float) -> list[tuple[int, tuple]]:
        """Events (worker, ("ready", info) | ("result", ep, kind, payload) | ("died", reason))."""
        ray = self._ray
        now = time.monotonic()
        for w in [w for w, at in self._ask_ready.items() if at <= now]:
            del self._ask_ready[w]
            self.start(w)
        if not self._refs:
            time.sleep(max(0.0, min(timeout_s, READY_RETRY_S)))
            return []
        refs = list(self._refs)
        wait_s = min(timeout_s, READY_RETRY_S) if self._ask_ready else timeout_s
        ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, wait_s))
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
                if tag == "ready":
                    self._not_ready(w, e)
                else:
                    reason = f"ray actor died ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                    events.append((w, ("died", reason)))
                    self._restarting.add(w)
                    self._forget(w)
                continue
            if tag == "ready":
                self._ready[w], self._pids[w] = True, value["pid"]
                self._restarting.discard(w)
                events.append((w, ("ready", value)))
                for op, items in self._queued[w]:
                    self.send(w, op, items)
                self._queued[w] = []
            else:
                events.append((w, ("result", tag, *value)))
        return events

    def _not_ready(self, w: int, error: Exception) -> None:
        """A `ready` call failed: Ray is still restarting the actor (ask again soon), or it is gone for good
        (restarts spent): a new actor in its slot."""
        if isinstance(error, self._ray.exceptions.ActorUnavailableError):
            self._ask_ready[w] = time.monotonic() + READY_RETRY_S
            return
        self._ray.kill(self._actors[w], no_restart=True)
        self._actors[w] = None
        self._restarting.discard(w)
        self.replaced += 1
        self.start(w)

    def _forget(self, w: int) -> None:
        for ref in [r for r, (worker, _) in self._refs.items() if worker == w]:
            del self._refs[ref]
        self._ask_ready.pop(w, None)
        self._queued[w] = []

    def kill(self, w: int) -> None:
        """End worker w's calls: a hung ready actor is killed for Ray to restart, one never ready is killed for good.

        One that died is left to Ray's restart; `start` then waits for it, or makes a new actor.
        """
        actor = self._actors[w]
        self._forget(w)
        if actor is None or w in self._restarting:
            return
        if self._ready[w]:
            self._ray.kill(actor, no_restart=False)
            self._restarting.add(w)
        else:
            self._ray.kill(actor, no_restart=True)
            self._actors[w] = None
            self.replaced += 1
        self._ready[w], self._pids[w] = False, None

    def pids(self) -> list[int | None]:
        return list(self._pids)

    def close(self) -> None:
        for w, actor in enumerate(self._actors):
            self._forget(w)
            if actor is not None:
                self._ray.kill(actor, no_restart=True)
            self._actors[w] = self._pids[w] = None
