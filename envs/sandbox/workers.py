"""Persistent sandbox workers: bubblewrap sandboxes each running a fork server that has already imported `PRELOAD`.

    with SandboxPool(size=2) as pool:
        result = pool.run("print(sum(range(10)))", limits=Limits(cpu_s=5, wall_s=10))   # a SandboxResult

A short program then costs a fork instead of a fresh sandbox and interpreter, with the isolation, limits and
results of `envs.sandbox.run`; nothing carries over between tasks. Design: docs/sandbox.md.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

from envs import sandbox
from envs.sandbox import launch, procs
from envs.sandbox.fork_worker import Worker, _Gone

PRELOAD = ("collections", "itertools", "functools", "math", "re", "string", "typing", "heapq", "bisect", "random",
           "statistics", "fractions", "decimal", "hashlib", "json", "copy", "operator", "dataclasses", "traceback",
           "types", "threading", "atexit")  # imported by every fork server before its first task
DEFAULT_SIZE = max(4, min(16, os.cpu_count() or 1))  # workers of a shared pool (started as concurrency needs)
_POOLS: weakref.WeakSet = weakref.WeakSet()


class SandboxPool:
    """Persistent sandbox workers running tasks one at a time each (thread-safe; a context manager).

    Args:
      size: most workers (and concurrent tasks); callers beyond it wait for a free worker.
      limits: per-task default `sandbox.Limits`; its disk_mb (each worker's tmpfs) and network are the pool's.
      preload: modules every fork server imports before its first task (missing ones are skipped).
    Raises TypeError/ValueError on bad arguments.
    """

    def __init__(self, size: int = DEFAULT_SIZE, *, limits: sandbox.Limits = sandbox.Limits(),
                 preload: Sequence[str] = PRELOAD) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"SandboxPool: size must be an int >= 1, got {size!r}")
        if not isinstance(limits, sandbox.Limits):
            raise TypeError(f"SandboxPool: limits must be a sandbox.Limits, got {type(limits).__name__}")
        if isinstance(preload, str) or not all(isinstance(m, str) for m in preload):
            raise TypeError(f"SandboxPool: preload must be a sequence of module names, got {preload!r}")
        self.size, self.limits, self.preload = size, limits, tuple(preload)
        self._reset()
        _POOLS.add(self)

    def _reset(self) -> None:
        self._cond, self._idle, self._live, self._closed, self._pid = threading.Condition(), [], set(), False, os.getpid()

    @property
    def workers(self) -> list[Worker]:
        """The live workers (idle or busy), for diagnostics and tests."""
        with self._cond:
            return [w for w in self._live if isinstance(w, Worker) and not w.dead]

    def start(self, count: int | None = None) -> None:
        """Start idle workers until `count` (default: size) are live. Raises RuntimeError/OSError on failure."""
        count = self.size if count is None else min(count, self.size)
        started = []
        try:
            while len(self._live) + len(started) < count:
                started.append(self._acquire())
        finally:
            for w in started:
                self._release(w)

    def run(self, files_or_code: str | Mapping[str, str | bytes], argv: Sequence[str] | None = None, *,
            limits: sandbox.Limits | None = None, stdin: str | None = None) -> sandbox.SandboxResult:
        """Run one program in a worker; arguments and result as `envs.sandbox.run` (no workspace, strict only).

        Raises TypeError/ValueError on bad arguments (limits whose disk_mb or network differ from the
        pool's included), RuntimeError when bubblewrap is missing or the pool is closed. A worker that
        cannot start, or dies twice before the program starts, gives status "infra_error".
        """
        limits = self.limits if limits is None else limits
        if not isinstance(limits, sandbox.Limits):
            raise TypeError(f"limits must be a sandbox.Limits, got {type(limits).__name__}")
        if (limits.disk_mb, limits.network) != (self.limits.disk_mb, self.limits.network):
            raise ValueError(f"SandboxPool.run: limits.disk_mb={limits.disk_mb}, network={limits.network} differ "
                             f"from the pool's ({self.limits.disk_mb}, {self.limits.network}); use another pool")
        files, argv = sandbox.check_program(files_or_code, argv, stdin)
        if launch.find_bwrap() is None:
            raise RuntimeError(f"SandboxPool: bubblewrap (bwrap) is not installed; install it with "
                               f"`{launch.INSTALL_HINT}` (or use envs.sandbox.run(isolation='weak'))")
        procs.install_signal_handlers()
        t0, reason = time.monotonic(), ""
        problem = sandbox.unrunnable(files, argv, stdin)
        if problem:
            return sandbox.refused(problem, t0)
        for _ in range(2):  # a worker that died before the program started is replaced once
            try:
                worker = self._acquire()
            except (OSError, RuntimeError) as e:
                if self._closed:
                    raise
                return sandbox._infra(f"could not start a sandbox worker: {e}", t0)
            try:
                return worker.run(files, argv, limits, stdin, t0)
            except _Gone as e:
                reason = str(e)
            finally:
                self._release(worker)
        return sandbox._infra(reason, t0)

    def _acquire(self) -> Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("SandboxPool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._live) < self.size:
                    placeholder = object()
                    self._live.add(placeholder)
                    break
                self._cond.wait()
        try:
            worker = Worker(disk_mb=self.limits.disk_mb, network=self.limits.network, preload=self.preload)
        finally:
            with self._cond:
                self._live.discard(placeholder)
                self._cond.notify()
        with self._cond:
            self._live.add(worker)
        return worker

    def _release(self, worker: Worker) -> None:
        with self._cond:
            if worker.dead or self._closed or self._pid != os.getpid():
                self._live.discard(worker)
                worker.close()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _forget(self) -> None:
        """In a forked child: drop the parent's workers without touching them (only our copies of fds)."""
        for w in list(self._live):
            if isinstance(w, Worker):
                w.forget()
        self._reset()

    def close(self) -> None:
        """Kill the idle workers now and busy ones when their task ends (idempotent)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            for w in idle:
                self._live.discard(w)
            self._cond.notify_all()
        for w in idle:
            w.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: dict[tuple, SandboxPool] = {}
_shared_lock = threading.Lock()


def shared_pool(limits: sandbox.Limits | None = None) -> SandboxPool:
    """This process's shared pool for `limits`' (disk_mb, network), closed at exit; pass the limits to `run` too."""
    limits = sandbox.Limits() if limits is None else limits
    key = (os.getpid(), limits.disk_mb, limits.network)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None or pool._closed:
            pool = _shared[key] = SandboxPool(limits=sandbox.Limits(disk_mb=limits.disk_mb, network=limits.network))
        return pool


def close_shared() -> None:
    """Close this process's shared pools (tests; exit does it anyway)."""
    with _shared_lock:
        pools = [p for k, p in _shared.items() if k[0] == os.getpid()]
        _shared.clear()
    for pool in pools:
        pool.close()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._forget()
    _shared.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_shared)  # before procs.kill_all (registered earlier, so run later) kills what is left
