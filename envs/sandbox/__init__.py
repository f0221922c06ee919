"""Run untrusted programs (model output) in a bubblewrap sandbox; rewards are only as good as this.

    result = run("print(sum(range(10)))", limits=Limits(cpu_s=5, wall_s=10))
    result.status, result.stdout   # ("ok", "45\\n")

Isolation, limits and cleanup: docs/sandbox.md. Many short programs: `envs.sandbox.workers.SandboxPool`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import selectors
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from envs.sandbox import files as sbx_files
from envs.sandbox import launch
from envs.sandbox import procs
from envs.sandbox.program import MAX_ARGV_BYTES, check_program, unrunnable  # noqa: F401  (re-exported)
from envs.sandbox.launch import SANDBOX_CWD, UID_BASE  # noqa: F401  (re-exported)
from envs.sandbox.procs import DIR_PREFIX, TMP_BASE, find_leaks, kill_all  # noqa: F401  (re-exported)

STATUSES = ("ok", "runtime_error", "timeout", "memory_limit", "disk_limit", "output_limit", "infra_error")
PYTHON: str = launch.sandbox_python()  # interpreter for Python programs inside the sandbox (has numpy)
_LAUNCHER_ENV = {"PATH": "/usr/bin:/bin"}  # bwrap itself gets no parent variables either (its /proc/pid/environ)
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_DISK_MARKERS = ("No space left on device", "File too large")
MEMORY_POLL_S = 0.05  # how often the memory of a running sandbox's processes is summed (seconds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Resource limits of one sandboxed run (how each is enforced: docs/sandbox.md).

    Attributes:
        cpu_s: CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds).
        wall_s: wall seconds of the whole run.
        memory_mb: MiB of all the sandbox's processes together (their summed PSS).
        max_procs: processes of the sandbox (RLIMIT_NPROC).
        max_output_bytes: cap on stdout and on stderr, each.
        disk_mb: MiB of cwd, /tmp and /dev/shm together (as root; otherwise /tmp and /dev/shm each).
        network: whether the sandbox shares the host's network.

    Raises ValueError on non-positive or non-finite values, TypeError on wrong types.
    """

    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_mb: int = 1024
    max_procs: int = 64
    max_output_bytes: int = 1 << 20
    disk_mb: int = 256
    network: bool = False

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "max_procs", "max_output_bytes", "disk_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Limits.{name} must be a number, got {value!r}")
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"Limits.{name} must be positive and finite, got {value!r}")
        for name in ("memory_mb", "max_procs", "max_output_bytes", "disk_mb"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"Limits.{name} must be an int, got {getattr(self, name)!r}")
        if not isinstance(self.network, bool):
            raise TypeError(f"Limits.network must be a bool, got {self.network!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """Outcome of one run: `status` one of STATUSES, `reason` why when it is not "ok".

    `returncode`: the exit code (128+N when killed by signal N), None when the program never ran or the harness
    killed it. Seconds: `wall_s`, and `cpu_s` of the program and the children it waited for (0 if unknown).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    reason: str = ""


# ----------------------------------------------------------------------------- workspace
class Workspace:
    """A private sandbox working dir that persists across `run(..., workspace=ws)` calls (a context manager).

    Runs in one workspace share its uid, so they must not overlap (RuntimeError). `read_bytes`/`read_text` refuse
    symlinks. Keep verifier state (expected answers) outside: the program can write anything here.
    """

    def __init__(self, disk_mb: int = Limits.disk_mb) -> None:
        Limits(disk_mb=disk_mb)  # validates
        self.disk_mb = disk_mb
        self._path: str | None = None
        self._uid: int | None = None
        self._storage: tuple[str, str | None] = ("", None)
        self._busy = threading.Lock()

    def __enter__(self) -> Workspace:
        if self._path is not None:
            raise RuntimeError("Workspace is already open")
        procs.install_signal_handlers()
        self._uid = launch.SLOTS.acquire()
        try:
            self._path = procs.make_dir(launch.host_uid(self._uid))
            self._storage = launch.prepare_storage(self._path, self._uid, self.disk_mb << 20)
        except BaseException:
            if self._path is not None:
                procs.remove_dir(self._path)
                self._path = None
            launch.SLOTS.release(self._uid)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the dir and free the uid (idempotent)."""
        if self._path is not None:
            procs.remove_dir(self._path)
            launch.SLOTS.release(self._uid)
            self._path = None

    @property
    def path(self) -> Path:
        """Host path of the working dir (as root under ``/proc/<holder>/root``); RuntimeError when not open."""
        if self._path is None:
            raise RuntimeError("Workspace is not open (use `with Workspace() as ws:`)")
        return Path(self._storage[0])

    def read_bytes(self, relpath: str, max_bytes: int = 1 << 20) -> bytes:
        """Up to max_bytes of a regular file. Raises FileNotFoundError, or OSError for symlinks/non-files."""
        *dirs, name = sbx_files.split_relpath(relpath)
        dfd = sbx_files.open_dir_chain(str(self.path), dirs, 0, create=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"workspace file {relpath!r} is not a regular file")
            return f.read(max_bytes)

    def read_text(self, relpath: str, max_bytes: int = 1 << 20) -> str:
        """`read_bytes` decoded as UTF-8 (invalid bytes replaced)."""
        return self.read_bytes(relpath, max_bytes).decode(errors="replace")


# ----------------------------------------------------------------------------- run
def run(files_or_code: str | Mapping[str, str | bytes], argv: Sequence[str] | None = None, *,
        limits: Limits = Limits(), stdin: str | None = None, workspace: Workspace | None = None,
        isolation: str = "strict") -> SandboxResult:
    """Run a program in a sandbox and return its SandboxResult (never raises for program failures).

    A sandbox that could not start, or a dir that could not be made, gives status "infra_error".

    Args:
      files_or_code: Python source (written to main.py; argv defaults to [PYTHON, "main.py"]) or a mapping of
        relative path -> str/bytes content written into the working dir (argv required).
      argv: the command, resolved inside the sandbox (PATH: the interpreter's bin, /usr/local/bin, /usr/bin, /bin).
      stdin: text fed to the program (default: empty).
      workspace: an open Workspace to run in (files persist); default: a fresh dir removed afterwards.
      isolation: "strict" (bubblewrap) or "weak" (unshare + rlimits, an explicit opt-in when bwrap is missing).

    Raises:
      TypeError, ValueError: bad arguments.
      RuntimeError: "strict" without bubblewrap (the message says what to install), no user namespaces, or an
        interpreter that cannot be shown inside (`mounts.check_visible`).
    """
    if isolation not in ("strict", "weak"):
        raise ValueError(f"isolation must be 'strict' or 'weak', got {isolation!r}")
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be a sandbox.Limits, got {type(limits).__name__}")
    files, argv = check_program(files_or_code, argv, stdin)
    procs.install_signal_handlers()
    t0 = time.monotonic()
    problem = unrunnable(files, argv, stdin)
    if problem:
        return refused(problem, t0)
    if workspace is not None:
        if not workspace._busy.acquire(blocking=False):
            raise RuntimeError("Workspace is already running a program; runs in one workspace must not overlap")
        try:
            return _run_in(workspace._path, workspace._storage, workspace._uid, files, argv, limits, stdin,
                           isolation, t0)
        finally:
            workspace._busy.release()
    uid = launch.SLOTS.acquire()
    try:
        try:
            host_dir = procs.make_dir(launch.host_uid(uid))
        except OSError as e:
            return _infra(f"could not create sandbox dir under {TMP_BASE}: {e}", t0)
        try:
            try:
                storage = launch.prepare_storage(host_dir, uid, limits.disk_mb << 20)
            except (OSError, RuntimeError) as e:
                return _infra(f"could not set up the sandbox's storage: {e}", t0)
            return _run_in(host_dir, storage, uid, files, argv, limits, stdin, isolation, t0)
        finally:
            procs.remove_dir(host_dir)
    finally:
        launch.SLOTS.release(uid)


def refused(problem: str, t0: float) -> SandboxResult:
    """The result of a program `unrunnable` refused: runtime_error, no exit code, the reason on stderr."""
    return SandboxResult(status="runtime_error", returncode=None, stdout="", stderr=f"cannot run: {problem}\n",
                         wall_s=time.monotonic() - t0, cpu_s=0.0, reason=problem)


def _infra(reason: str, t0: float, stdout: str = "", stderr: str = "") -> SandboxResult:
    return SandboxResult(status="infra_error", returncode=None, stdout=stdout, stderr=stderr,
                         wall_s=time.monotonic() - t0, cpu_s=0.0, reason=reason)


def _run_in(host_dir, storage, uid, files, argv, limits, stdin, isolation, t0) -> SandboxResult:
    """Run in sandbox dir `host_dir`; storage = (working dir as the host sees it, root of its capped fs or None)."""
    work, fs_root = storage
    try:
        sbx_files.write_files(work, files, launch.host_uid(uid))
    except OSError as e:
        return _infra(f"could not write program files: {e}", t0)
    stdin_fd, seccomp = None, launch.seccomp_fd()
    if stdin:
        stdin_fd = os.memfd_create("sandbox-stdin")
        os.write(stdin_fd, stdin.encode())
    try:
        cmd, pass_fds = launch.build_argv(argv, limits, host_dir=host_dir, work_dir=work, inner_uid=uid,
                                          stdin_fd=stdin_fd, isolation=isolation, holder_fs=fs_root is not None,
                                          seccomp=seccomp)
        started_r, started_w = os.pipe()
        try:
            proc, tree = _spawn(cmd, started_w, pass_fds)
        except OSError as e:
            os.close(started_r)
            return _infra(f"could not start the sandbox ({cmd[0]}): {e}", t0)
        finally:
            os.close(started_w)
    finally:
        for fd in (stdin_fd, seccomp):
            if fd is not None:
                os.close(fd)
    try:
        out, err, status_bytes, why = _communicate(proc, tree, started_r, limits.max_output_bytes,
                                                   t0 + limits.wall_s, limits.memory_mb << 20)
        if why:
            tree.kill()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        tree.wait_init_gone()  # bwrap may exit before its namespace is torn down
    finally:
        if proc.returncode is None:  # an exception escaped: leave nothing behind
            tree.kill()
            proc.wait()
            tree.wait_init_gone()
        killed = procs.unregister(tree)
        tree.close(), os.close(started_r), proc.stdout.close(), proc.stderr.close()
    rc = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return _classify(limits, started=status_bytes.startswith(b"x"), why=why, killed=killed, rc=rc, stdout=out,
                     stderr=err, wall=time.monotonic() - t0, cpu=_program_cpu_s(status_bytes, usage),
                     disk_full=launch.disk_full(fs_root) or (fs_root is not None and rc == 128 + signal.SIGBUS))


def _program_cpu_s(status: bytes, usage) -> float:
    """CPU seconds of the program tree from sh's `times` line ("0m1.004000s 0m0.004000s"), else rusage."""
    lines = status[1:].decode(errors="replace").split("\n")
    try:
        user, sys_ = (float(m) * 60 + float(s.rstrip("s")) for m, s in (t.split("m") for t in lines[1].split()))
        return user + sys_
    except (IndexError, ValueError):
        return usage.ru_utime + usage.ru_stime


def _spawn(cmd: list[str], started_w: int, pass_fds: list[int]) -> tuple[subprocess.Popen, procs.Tree]:
    """Start the sandbox (fd 0: the "started" pipe) and register it before a signal can interrupt us."""
    with procs.LOCK:
        proc = subprocess.Popen(cmd, stdin=started_w, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=pass_fds, start_new_session=True, env=_LAUNCHER_ENV)
        return proc, procs.register(proc.pid)


def _classify(limits: Limits, *, started: bool, why: str, killed: bool, rc: int, stdout: bytes, stderr: bytes,
              wall: float, cpu: float, disk_full: bool = False) -> SandboxResult:
    """Map how the run ended to a status. Only the harness (never program output) yields infra_error."""
    out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")

    def result(status: str, reason: str = "", code: int | None = rc) -> SandboxResult:
        return SandboxResult(status=status, returncode=code, stdout=out, stderr=err, wall_s=wall, cpu_s=cpu,
                             reason=reason)

    if killed:
        return result("infra_error", "sandbox killed because the parent is shutting down", None)
    if not started:  # sh never reached the program: bwrap/setup failed (or the harness timed out)
        if why == "wall":
            return result("infra_error", f"sandbox did not start within wall_s={limits.wall_s}", None)
        return result("infra_error", f"sandbox failed to start (exit {rc}): {err.strip()[-500:]}", None)
    if why == "output":
        return result("output_limit", f"output exceeded max_output_bytes={limits.max_output_bytes}", None)
    if why == "wall":
        return result("timeout", f"wall: exceeded wall_s={limits.wall_s}", None)
    if why == "memory":
        return result("memory_limit", f"memory: the sandbox's processes together exceeded memory_mb={limits.memory_mb}",
                      None)
    if rc == 128 + signal.SIGXCPU or (rc == 128 + signal.SIGKILL and cpu >= math.ceil(limits.cpu_s)):
        return result("timeout", f"cpu: exceeded cpu_s={limits.cpu_s}")
    if disk_full or rc == 128 + signal.SIGXFSZ or (rc != 0 and any(m in err[-4096:] for m in _DISK_MARKERS)):
        return result("disk_limit", f"disk: exceeded disk_mb={limits.disk_mb} (cwd, /tmp and /dev/shm together)")
    if rc != 0 and any(m in err[-4096:] for m in _MEMORY_MARKERS):
        return result("memory_limit", f"memory: exceeded memory_mb={limits.memory_mb}")
    if rc != 0:
        return result("runtime_error", f"exit code {rc}")
    return result("ok")


def _communicate(proc, tree: procs.Tree, started_r: int, cap: int, deadline: float, memory_cap: int):
    """Read stdout/stderr (each capped at `cap` bytes) until the process exited and every pipe closed, or a limit hit.

    Memory is polled every MEMORY_POLL_S. Returns (stdout, stderr, started, why), why: "", "wall", "output" or "memory".
    """
    next_poll = time.monotonic() + MEMORY_POLL_S
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status, why = bytearray(), ""
    with selectors.DefaultSelector() as sel:
        for fd in (*bufs, started_r, tree.pidfd):
            if fd != tree.pidfd:
                os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not why:
            now = time.monotonic()
            if now >= deadline:
                why = "wall"
                break
            if now >= next_poll:
                next_poll = now + MEMORY_POLL_S
                if tree.memory_bytes() > memory_cap:
                    why = "memory"
                    break
            for key, _ in sel.select(min(deadline, next_poll) - now):
                if key.fd == tree.pidfd:
                    sel.unregister(tree.pidfd)
                    continue
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                elif key.fd == started_r:
                    if not status:
                        tree.find_init()  # the program runs, so bwrap's init exists now
                    status += data[:256]
                else:
                    buf = bufs[key.fd]
                    buf += data[: cap + 1 - len(buf)]
                    if len(buf) > cap:
                        why = "output"
                        del buf[cap:]
                        break
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), bytes(status), why
