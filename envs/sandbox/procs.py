"""Registry of live sandboxes (process trees + temp dirs) and their cleanup (private helper of `envs.sandbox`).

`kill_all` kills and removes them all, at exit and on SIGINT/SIGTERM (chained to the previous handlers).
Processes are addressed through pidfds, so a recycled pid is never signalled.
"""
from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading

from envs.sandbox.launch import UID_BASE

TMP_BASE = tempfile.gettempdir()  # sandbox temp dirs live here ...
DIR_PREFIX = "posttrain-sbx-"  # ... named DIR_PREFIX + "<pid>-<random>"

LOCK = threading.RLock()  # reentrant: the signal handler runs on the main thread, maybe inside LOCK
LIVE: dict[int, Tree] = {}  # bwrap pid -> tree
DIRS: set[str] = set()
KILLED: set[int] = set()  # bwrap pids killed by kill_all (their runs report infra_error)


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def _kill(fd: int | None) -> None:
    if fd is not None:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass


class Tree:
    """One sandbox: bwrap and, once known, its pid-namespace init, whose exit takes the whole namespace with it."""

    def __init__(self, pid: int) -> None:
        self.pid, self.pidfd, self.init_fd, self.init_pid = pid, os.pidfd_open(pid), None, None
        self.expected: tuple[int, ...] = ()  # host pids of a persistent worker's own processes (its server)
        self.dirs: tuple[str, ...] = ()  # a persistent worker's sandbox dir

    def find_init(self) -> None:
        """Remember bwrap's child (call while bwrap is alive, e.g. once the program has started)."""
        if self.init_fd is None:
            for child in _children(self.pid):
                try:
                    self.init_fd, self.init_pid = os.pidfd_open(child), child
                    return
                except OSError:
                    pass

    def memory_bytes(self, skip: frozenset[int] = frozenset()) -> int:
        """Bytes of the sandbox's processes but `skip` (their children count): summed PSS, so forks count once.

        From /proc/<pid>/smaps_rollup; 0 before the init is known (`find_init`).
        """
        total, todo, seen = 0, [self.init_pid] if self.init_pid else [], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            if pid in skip:
                todo += _children(pid)
                continue
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    total += next((int(line.split()[1]) << 10 for line in f if line.startswith("Pss:")), 0)
            except (OSError, ValueError):
                pass
            todo += _children(pid)
        return total

    def kill(self) -> None:
        """SIGKILL the namespace init (taking every process in the namespace with it) and bwrap."""
        self.find_init()
        _kill(self.init_fd)
        _kill(self.pidfd)

    def wait_init_gone(self, timeout_s: float = 5.0) -> None:
        """Block until the namespace init (if known) has exited; SIGKILL it after `timeout_s`."""
        if self.init_fd is not None and not select.select([self.init_fd], [], [], timeout_s)[0]:
            _kill(self.init_fd)
            select.select([self.init_fd], [], [], timeout_s)

    def close(self) -> None:
        for fd in (self.pidfd, self.init_fd):
            if fd is not None:
                os.close(fd)


def register(pid: int) -> Tree:
    with LOCK:
        tree = LIVE[pid] = Tree(pid)
    return tree


def unregister(tree: Tree) -> bool:
    """Forget `tree`; True if kill_all killed it meanwhile."""
    with LOCK:
        LIVE.pop(tree.pid, None)
        killed = tree.pid in KILLED
        KILLED.discard(tree.pid)
    return killed


def kill_all() -> None:
    """Kill every live sandbox of this process and remove every sandbox temp dir (idempotent)."""
    with LOCK:
        for pid, tree in list(LIVE.items()):
            KILLED.add(pid)
            tree.kill()
        for d in list(DIRS):
            remove_tree(d)
            DIRS.discard(d)


_handlers_installed = False


def install_signal_handlers() -> None:
    """On SIGINT/SIGTERM: kill_all, then the previous handler (a default action is re-raised).

    Only possible from the main thread; called at import and on every use until it succeeds.
    """
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            kill_all()
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:  # SIG_DFL or a C-level handler: die as if we were not here
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


def _after_fork_in_child() -> None:  # a forked child must not kill or delete its parent's sandboxes
    global LOCK
    LOCK = threading.RLock()
    LIVE.clear(), DIRS.clear(), KILLED.clear()


atexit.register(kill_all)
os.register_at_fork(after_in_child=_after_fork_in_child)

_sweep_lock = threading.Lock()
_swept = False


def _sweep_stale_dirs() -> None:
    """Remove sandbox dirs left by processes that no longer exist (e.g. a SIGKILLed parent)."""
    for name in os.listdir(TMP_BASE):
        if name.startswith(DIR_PREFIX):
            pid = name[len(DIR_PREFIX):].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                remove_tree(os.path.join(TMP_BASE, name))


def make_dir(owner_uid: int) -> str:
    """A new private sandbox dir under TMP_BASE, owned by `owner_uid`, registered for cleanup.

    Raises OSError when it cannot be created.
    """
    global _swept
    with _sweep_lock:
        if not _swept:
            _swept = True
            _sweep_stale_dirs()
    path = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=TMP_BASE)
    with LOCK:
        DIRS.add(path)
    os.chown(path, owner_uid, owner_uid)
    return path


def remove_tree(path: str) -> None:
    """Delete a sandbox dir whatever the program left in it (never raises).

    Falls back to coreutils `rm`: shutil.rmtree recurses in Python and raises RecursionError on deeply nested dirs.
    """
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except (OSError, RecursionError):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)


def remove_dir(path: str) -> None:
    remove_tree(path)
    with LOCK:
        DIRS.discard(path)


def find_leaks() -> list[str]:
    """Descriptions of this process's sandbox processes and temp dirs still around (empty when all is clean).

    Processes: bwrap descendants, and processes of a sandbox uid (>= UID_BASE) that descend from us or have no bwrap
    ancestor. Dirs: TMP_BASE/posttrain-sbx-<our pid>-*. A live persistent worker's bwrap, init, server and dir are
    not leaks; what its tasks leave is.
    """
    import psutil

    me, leaks = os.getpid(), []
    with LOCK:
        allow = [t for t in LIVE.values() if t.expected]
    allowed = {pid for t in allow for pid in (t.pid, t.init_pid, *t.expected) if pid}
    allowed_dirs = {os.path.basename(d) for t in allow for d in t.dirs}
    for child in psutil.Process(me).children(recursive=True):
        try:
            if child.name() == "bwrap" and child.pid not in allowed:
                leaks.append(f"process {child.pid} (bwrap) still running")
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter(["uids", "name"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real < UID_BASE or proc.pid in allowed:
                continue
            chain = proc.parents()
            if any(p.pid == me for p in chain) or not any(p.name() == "bwrap" for p in chain):
                leaks.append(f"process {proc.pid} ({proc.info['name']}, uid {proc.info['uids'].real}) still running")
        except psutil.Error:
            pass
    leaks += [f"dir {os.path.join(TMP_BASE, n)} still exists" for n in os.listdir(TMP_BASE)
              if n.startswith(f"{DIR_PREFIX}{me}-") and n not in allowed_dirs]
    return leaks
