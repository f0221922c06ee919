"""EnvPool: batched reset/step over many gymnasium text environments living in worker processes or Ray actors.

Episode i of a reset lives in worker i % num_workers; a timeout, a worker's death or an env's exception ends only
the episodes it touched, as infra_error (never a wrong answer), and the worker is restarted. Usage, the worker
protocol and the Ray backend (`envs.pool.ray_pool`): docs/pool.md.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from envs.sandbox.procs import DIR_PREFIX, TMP_BASE, remove_tree


BACKENDS = ("process", "ray")  # EnvPool's worker kinds (a run's env.backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSpec:
    """One episode: ``gymnasium.make(env_id, **env_kwargs)`` reset with `seed` and, unless None, ``{"task": task}``."""

    env_id: str
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    task: Any = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ValueError(f"EpisodeSpec.env_id must be a non-empty str, got {self.env_id!r}")
        if not isinstance(self.env_kwargs, Mapping):
            raise TypeError(f"EpisodeSpec.env_kwargs must be a mapping, got {type(self.env_kwargs).__name__}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"EpisodeSpec.seed must be an int or None, got {self.seed!r}")


class StepResult(NamedTuple):
    """One episode's step tuple; `reward` a float, or the env's own value, never coerced (`envs.base.as_reward`)."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict


def _infra_info(reason: str) -> dict:
    return {"status": "infra_error", "reason": reason}


def _as_spec(spec: Any) -> EpisodeSpec:
    """An EpisodeSpec from an EpisodeSpec or a look-alike (e.g. posttrain.rollout.episodes.Episode)."""
    if isinstance(spec, EpisodeSpec):
        return spec
    try:
        return EpisodeSpec(env_id=spec.env_id, env_kwargs=spec.env_kwargs, task=spec.task, seed=spec.seed)
    except AttributeError as e:
        raise TypeError(f"reset() takes EpisodeSpec-like items (env_id, env_kwargs, task, seed), got "
                        f"{type(spec).__name__}") from e


class _Worker:
    """Parent-side state of one worker slot (whatever the backend)."""

    def __init__(self) -> None:
        self.ready, self.started_at, self.info = False, time.monotonic(), {}
        self.pending: deque[int] = deque()  # episodes sent this call, in processing order
        self.deadline = float("inf")


class ProcessWorkers:
    """Backend: workers as ``python -m envs.pool.env_host`` subprocesses on socketpairs."""

    def __init__(self, num_workers: int, imports: Sequence[str]) -> None:
        self._imports = list(imports)
        self._procs: list[subprocess.Popen | None] = [None] * num_workers
        self._conns: list[Connection | None] = [None] * num_workers
        for w in range(num_workers):
            self.start(w)

    def start(self, w: int) -> None:
        parent_end, child_end = socket.socketpair()
        path = [p or os.getcwd() for p in sys.path]  # what the parent can import, the worker can too
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        try:
            self._procs[w] = subprocess.Popen(
                [sys.executable, "-m", "envs.pool.env_host", str(child_end.fileno()), *self._imports],
                pass_fds=[child_end.fileno()], env=env, start_new_session=True)
        finally:
            child_end.close()
        self._conns[w] = Connection(parent_end.detach())

    def send(self, w: int, op: str, items: list) -> None:
        try:
            self._conns[w].send((op, items))
        except OSError:
            pass  # a dead worker shows up as EOF in poll

    def poll(self, timeout_s: float) -> list[tuple[int, tuple]]:
        """Events (worker, ("ready", info) | ("result", ep, kind, payload) | ("died", reason))."""
        index = {id(c): w for w, c in enumerate(self._conns) if c is not None}
        events = []
        for conn in wait([c for c in self._conns if c is not None], timeout=max(0.0, timeout_s)):
            w = index[id(conn)]
            try:
                events.append((w, conn.recv()))
            except (EOFError, OSError):
                events.append((w, ("died", f"worker process died ({self._exit_reason(w)})")))
                self._conns[w].close()
                self._conns[w] = None
        return events

    def _exit_reason(self, w: int) -> str:
        proc = self._procs[w]
        try:
            rc = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"

    def kill(self, w: int) -> None:
        proc, conn = self._procs[w], self._conns[w]
        if proc is not None:
            proc.kill()
            proc.wait()
            for d in glob.glob(os.path.join(TMP_BASE, f"{DIR_PREFIX}{proc.pid}-*")):  # its sandboxes' dirs
                remove_tree(d)
        if conn is not None:
            conn.close()
        self._procs[w] = self._conns[w] = None

    def pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self._procs]

    def close(self) -> None:
        for w, conn in enumerate(self._conns):
            if conn is not None:
                self.send(w, "close", None)
        deadline = time.monotonic() + 5.0
        for w, proc in enumerate(self._procs):
            if proc is not None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self.kill(w)


class EnvPool:
    """Batched gymnasium episodes over `num_workers` workers with per-item timeouts (not thread-safe: one caller).

    Args:
      step_timeout_s: seconds one env.step may take, from when the worker starts that item; reset_timeout_s: the
        same for make + reset (default: step_timeout_s); startup_timeout_s: for a (re)started worker's imports.
      imports: modules each worker imports first (registrations).
      ray_actor_options: `ray.remote` options over `ray_pool.DEFAULT_ACTOR_OPTIONS`; max_task_retries is always 0.

    Raises ValueError/TypeError on bad arguments; ImportError for backend="ray" without ray.
    """

    def __init__(self, num_workers: int = 8, *, step_timeout_s: float = 30.0, reset_timeout_s: float | None = None,
                 startup_timeout_s: float = 120.0, backend: str = "process", imports: Sequence[str] = ("envs",),
                 ray_actor_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        for name, value in (("step_timeout_s", step_timeout_s), ("startup_timeout_s", startup_timeout_s),
                            ("reset_timeout_s", step_timeout_s if reset_timeout_s is None else reset_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if backend == "process":
            self._backend = ProcessWorkers(num_workers, imports)
        elif backend == "ray":
            from envs.pool.ray_pool import RayWorkers

            self._backend = RayWorkers(num_workers, imports, ray_actor_options)
        else:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.num_workers, self.backend = num_workers, backend
        self.step_timeout_s, self.startup_timeout_s = float(step_timeout_s), float(startup_timeout_s)
        self.reset_timeout_s = float(step_timeout_s if reset_timeout_s is None else reset_timeout_s)
        self._workers = [_Worker() for _ in range(num_workers)]
        self._active: set[int] = set()
        self._lost: dict[int, StepResult] = {}  # active episodes whose env is gone: their next step result
        self.restarts = self.infra_errors = 0
        self._closed = False

    # ------------------------------------------------------------------ public API
    @property
    def active(self) -> list[int]:
        """Episode indices (of the last reset) not yet terminated/truncated, ascending."""
        return sorted(self._active)

    @property
    def worker_pids(self) -> list[int | None]:
        """Worker process ids (process backend; None while a worker is being replaced)."""
        return self._backend.pids()

    def reset(self, specs: Sequence[EpisodeSpec]) -> list[tuple[str, dict]]:
        """Start episodes 0..len(specs)-1 (dropping any still active); returns [(observation, info)].

        Items: EpisodeSpec or any object with env_id, env_kwargs, task and seed (else TypeError). A failed reset gives
        ("", info) with info["status"] == "infra_error"; that episode's next step returns the error and ends it.
        """
        self._check_open()
        specs = [_as_spec(s) for s in specs]
        items = {ep: (ep, s.env_id, dict(s.env_kwargs), s.task, s.seed) for ep, s in enumerate(specs)}
        self._active, self._lost = set(items), {}
        out = self._run("reset", items, self.reset_timeout_s)
        results = []
        for ep in range(len(specs)):
            kind, payload = out[ep]
            if kind == "ok":
                results.append((payload[0], payload[1]))
            else:
                self._lost[ep] = StepResult("", 0.0, False, True, _infra_info(payload))
                results.append(("", _infra_info(payload)))
        return results

    def step(self, actions: Sequence[str] | Mapping[int, str], indices: Sequence[int] | None = None
             ) -> list[StepResult]:
        """Step episodes once: `actions[k]` to episode `indices[k]` (default: `active`), or a mapping {episode: action}.

        Returns the StepResults in that order (ascending keys for a mapping); an episode whose env was lost returns its
        infra_error. Raises ValueError for inactive or repeated episodes or a length mismatch, TypeError for non-str
        actions.
        """
        self._check_open()
        if isinstance(actions, Mapping):
            episodes, actions = sorted(actions), [actions[ep] for ep in sorted(actions)]
        else:
            actions = list(actions)
            episodes = self.active if indices is None else list(indices)
            if len(actions) != len(episodes):
                raise ValueError(f"step() got {len(actions)} actions for {len(episodes)} episodes")
        bad = [ep for ep in episodes if ep not in self._active]
        if bad or len(set(episodes)) != len(episodes):
            raise ValueError(f"step(): episodes {bad or episodes} are not active or repeated (active: {self.active})")
        for ep, a in zip(episodes, actions):
            if not isinstance(a, str):
                raise TypeError(f"step(): action for episode {ep} must be str, got {type(a).__name__}")
        items = {ep: (ep, a) for ep, a in zip(episodes, actions) if ep not in self._lost}
        out = self._run("step", items, self.step_timeout_s)
        results = []
        for ep in episodes:
            if ep in out:
                kind, payload = out[ep]
                result = StepResult(*payload) if kind == "ok" else StepResult("", 0.0, False, True, _infra_info(payload))
            else:
                result = self._lost.pop(ep)
            if result.terminated or result.truncated:
                self._active.discard(ep)
            results.append(result)
        return results

    def close(self) -> None:
        """Stop all workers (idempotent). Also called by the context manager."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    # ------------------------------------------------------------------ driver
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")

    def _run(self, op: str, items: dict[int, tuple], timeout_s: float) -> dict[int, tuple[str, Any]]:
        """Send items to their workers and collect {episode: (kind, payload)} for every episode of
        `items`, plus infra errors for other active episodes of workers that died meanwhile."""
        out: dict[int, tuple[str, Any]] = {}
        for w in range(self.num_workers):
            mine = [items[ep] for ep in sorted(items) if ep % self.num_workers == w]
            if mine:
                self._workers[w].pending = deque(item[0] for item in mine)
                self._arm(w, timeout_s)
                self._backend.send(w, op, mine)
            elif op == "reset":  # let an idle worker drop its envs from the previous batch
                self._backend.send(w, "release", [])
        while any(wk.pending for wk in self._workers):
            now = time.monotonic()
            for w, wk in enumerate(self._workers):
                if wk.pending and now >= wk.deadline:
                    what = "start" if not wk.ready else f"{op} of episode {wk.pending[0]}"
                    limit = self.startup_timeout_s if not wk.ready else timeout_s
                    self._backend.kill(w)
                    self._fail(w, f"worker timed out: {what} took longer than {limit:g} s", out)
            deadline = min((wk.deadline for wk in self._workers if wk.pending), default=now)
            for w, event in self._backend.poll(deadline - now):
                wk = self._workers[w]
                if event[0] == "ready":
                    wk.ready, wk.info = True, event[1]
                    self._arm(w, timeout_s)
                elif event[0] == "result":
                    _, ep, kind, payload = event
                    if ep in wk.pending:  # else: a late result from a worker already given up on
                        wk.pending.remove(ep)
                        out[ep] = (kind, payload)
                        self._arm(w, timeout_s)
                elif event[0] == "died":
                    self._backend.kill(w)
                    self._fail(w, event[1], out)
        self.infra_errors += sum(kind != "ok" for kind, _ in out.values())
        return out

    def _arm(self, w: int, timeout_s: float) -> None:
        wk = self._workers[w]
        wk.deadline = time.monotonic() + timeout_s if wk.ready else wk.started_at + self.startup_timeout_s

    def _fail(self, w: int, reason: str, out: dict) -> None:
        """Worker w is dead: end its unfinished episodes as infra_error and start a replacement.

        Episodes of this call get their error in `out`; other active episodes it held report theirs
        at their next step (`_lost`)."""
        wk = self._workers[w]
        lost_reason = f"worker restarted ({reason}); episode state lost"
        first = wk.pending[0] if wk.pending else None
        for ep in wk.pending:
            out[ep] = ("error", reason if ep == first else lost_reason)
        for ep, (kind, payload) in list(out.items()):  # done earlier this call, but the env state is gone
            if ep % self.num_workers == w and kind == "ok" and not (len(payload) == 5 and (payload[2] or payload[3])):
                out[ep] = ("error", lost_reason)
        for ep in self._active:
            if ep % self.num_workers == w and ep not in out and ep not in self._lost:
                self._lost[ep] = StepResult("", 0.0, False, True, _infra_info(lost_reason))
                self.infra_errors += 1
        self._workers[w] = _Worker()
        self._backend.start(w)
        self.restarts += 1
