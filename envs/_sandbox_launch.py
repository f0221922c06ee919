"""Command lines that start one sandboxed program (private helper of `envs.sandbox`; no JAX).

Strict isolation (bubblewrap), as root:
  * One user namespace per host process (the "holder"), created once: inner uid/gid 0 -> host 0 (so
    bwrap can bind-mount root-owned paths), inner FIRST_SLOT_UID+k -> host UID_BASE+FIRST_SLOT_UID+k,
    nested user namespaces disabled inside it (`user.max_user_namespaces=0`). bwrap joins it
    (``--userns``); the program inherits that fd, which grants nothing (setns into it fails).
  * Each running sandbox gets its own inner uid (a *slot*): RLIMIT_NPROC is counted per (namespace,
    uid), so `max_procs` bounds each sandbox separately, and the host uid is unprivileged, so the limit
    applies at all (root ignores RLIMIT_NPROC). Sandbox processes are recognisable on the host by
    their host uid >= UID_BASE.
  * The exec chain is ``bwrap -> setpriv (uid/gid, drop caps) -> sh (ulimits) -> program``; sh forks
    the program (to report its CPU time with `times`), so two tiny execs and a fork (~2-4 ms). bwrap's
    own ``--uid/--gid`` cannot be used with ``--userns`` as root (it calls setuid before setgid).
  * sh writes a "started" byte to fd 0 (a pipe only the harness reads) right before running the
    program, whose stdin is redirected: "the sandbox failed to start" (infra_error) cannot be forged
    by program output, and a setup failure is never mistaken for a wrong answer.
As a non-root user bwrap makes its own user namespace (``--unshare-user``); the caller is already
unprivileged, so RLIMIT_NPROC applies. `isolation="weak"` (explicit opt-in, only used when bwrap is
missing) is util-linux `unshare` (pid/net/ipc/uts/mount namespaces) + rlimits: no filesystem view, and
as root no process-count bound.
"""
from __future__ import annotations

import glob
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

UID_BASE = 1_700_000_000  # inner uid FIRST_SLOT_UID+k of the holder namespace is host uid UID_BASE+FIRST_SLOT_UID+k
FIRST_SLOT_UID = 10_000  # no /etc/passwd entry, so tools print a bare number
MAX_SLOTS = 60_000
SANDBOX_CWD = "/tmp/work"  # the working directory as the sandboxed program sees it
TMPFS_BYTES = 128 << 20  # size of the sandbox's private /tmp and /dev/shm
FILE_SIZE_LIMIT_BYTES = 128 << 20  # RLIMIT_FSIZE: largest file the program may write
NOFILE_LIMIT = 1024
HIDDEN_DIRS = ("/root", "/home", "/run", "/tmp")  # replaced by empty tmpfs inside the sandbox
PROJECT_ROOT = str(Path(__file__).resolve().parents[1])  # the checkout: hidden too (read-only + no peeking)
INSTALL_HINT = "apt-get install -y bubblewrap"


def find_bwrap() -> str | None:
    """Path of the bubblewrap binary (env POSTTRAIN_BWRAP overrides; '' means "pretend missing")."""
    override = os.environ.get("POSTTRAIN_BWRAP")
    if override is not None:
        return override if override and os.access(override, os.X_OK) else None
    return shutil.which("bwrap")


def sandbox_python() -> str:
    """The interpreter that runs Python programs inside the sandbox (env POSTTRAIN_SANDBOX_PYTHON or
    the current interpreter, i.e. the project venv's python, which can ``import numpy``)."""
    return os.environ.get("POSTTRAIN_SANDBOX_PYTHON", sys.executable)


# ----------------------------------------------------------------------------- uid slots
class SlotPool:
    """Thread-safe allocator of inner uids FIRST_SLOT_UID + k, k in [0, MAX_SLOTS)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._next >= MAX_SLOTS:
                raise RuntimeError(f"sandbox: more than {MAX_SLOTS} concurrent sandboxes")
            self._next += 1
            return FIRST_SLOT_UID + self._next - 1

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


SLOTS = SlotPool()


def host_uid(inner_uid: int) -> int:
    """Host uid of a sandbox slot's inner uid (root mode; in user mode the caller's uid)."""
    return UID_BASE + inner_uid if os.geteuid() == 0 else os.getuid()


# ----------------------------------------------------------------------------- holder namespace
_holder_lock = threading.Lock()
_holder: tuple[int, int] | None = None  # (owner pid, fd of the user namespace)


def holder_userns_fd() -> int:
    """fd of this process's holder user namespace (created on first use; root only).

    Raises RuntimeError if user namespaces cannot be created or configured here.
    """
    global _holder
    with _holder_lock:
        if _holder is not None and _holder[0] == os.getpid():
            return _holder[1]
        # The child execs sh a second time after the maps exist, so it holds full capabilities in the
        # namespace (exec with an unmapped uid drops them) and can disable nested user namespaces.
        script = "read x; exec /bin/sh -c 'echo 0 > /proc/sys/user/max_user_namespaces && echo ok; read y'"
        try:
            proc = subprocess.Popen(["unshare", "--user", "--", "/bin/sh", "-c", script],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            raise RuntimeError(f"sandbox: cannot start util-linux `unshare` ({e})") from e
        try:
            mine, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + 10.0
            while os.readlink(f"/proc/{proc.pid}/ns/user") == mine:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sandbox: `unshare --user` failed: "
                                       + proc.stderr.read().decode(errors="replace").strip())
                time.sleep(0.0005)
            ids = f"0 0 1\n{FIRST_SLOT_UID} {UID_BASE + FIRST_SLOT_UID} {MAX_SLOTS}\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{proc.pid}/{name}", "w") as f:
                    f.write(ids)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            if proc.stdout.readline() != b"ok\n":
                raise RuntimeError("sandbox: cannot disable nested user namespaces: "
                                   + proc.stderr.read().decode(errors="replace").strip())
            fd = os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        _holder = (os.getpid(), fd)
        return fd


# ----------------------------------------------------------------------------- mounts
def _ancestors_below(path: str, top: str) -> list[str]:
    """Directories strictly between `top` and `path` (outermost first)."""
    rel = Path(path).relative_to(top).parts[:-1]
    return [str(Path(top, *rel[: i + 1])) for i in range(len(rel))]


def _mount_args(python: str, network: bool) -> list[str]:
    """bwrap mount options: read-only system, hidden private dirs, the interpreter re-exposed."""
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    hidden = [d for d in (*HIDDEN_DIRS, PROJECT_ROOT) if os.path.isdir(d) and d != "/"
              and not (network and d == "/run")]  # /etc/resolv.conf often points into /run
    for d in hidden:
        perms = "1777" if d == "/tmp" else "0755"
        args += ["--perms", perms, "--size", str(TMPFS_BYTES), "--tmpfs", d]
    args += ["--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm"]
    # The interpreter (venv and its base install) may live under a hidden dir: bind it back.
    exe = os.path.realpath(python)
    needed = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(exe))} if python == sys.executable \
        else {os.path.dirname(os.path.dirname(exe)), os.path.dirname(os.path.dirname(python))}
    for path in sorted({os.path.realpath(p) for p in needed} | needed):
        top = next((d for d in hidden if path != d and path.startswith(d.rstrip("/") + "/")), None)
        if top is None or not os.path.isdir(path):
            continue
        for d in _ancestors_below(path, top):
            args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", path, path]
    # Editable installs point into the (hidden) checkout; their .pth only slows start-up (~10 ms).
    for pth in glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "__editable__*.pth")):
        args += ["--ro-bind", "/dev/null", pth]
    return args


def environment(python: str) -> dict[str, str]:
    """The complete environment of the sandboxed program (nothing is inherited from the parent)."""
    bindir = os.path.dirname(python)
    return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MALLOC_ARENA_MAX": "2"}


_static_cache: dict[tuple, list[str]] = {}


def _static_bwrap_args(bwrap: str, python: str, network: bool, root: bool) -> list[str]:
    key = (bwrap, python, network, root, os.getpid())
    if key not in _static_cache:
        args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try"]
        args += [] if network else ["--unshare-net"]
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"] if root \
            else ["--unshare-user", "--disable-userns"]
        args += _mount_args(python, network) + ["--clearenv"]
        for k, v in environment(python).items():
            args += ["--setenv", k, v]
        _static_cache[key] = args
    return _static_cache[key]


# ----------------------------------------------------------------------------- limits
def clamp_limit(which: int, value: int) -> int:
    """`value` clamped to the current hard limit of resource `which` (asking for more is not an error)."""
    hard = resource.getrlimit(which)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _ulimit_script(limits, stdin_fd: int | None) -> str:
    """sh script run with fd 0 = the "started" pipe: set rlimits (soft and hard), write "x" to it, run
    "$@" with stdin from memfd `stdin_fd` (or /dev/null), write `times` (user/sys of sh and of its
    children) to the pipe, exit with the program's status. dash only addresses fds 0-9, hence fd 0."""
    cpu_soft = clamp_limit(resource.RLIMIT_CPU, max(1, math.ceil(limits.cpu_s)))
    cpu_hard = clamp_limit(resource.RLIMIT_CPU, cpu_soft + 1)
    kib = lambda b: max(1, b // 1024)  # noqa: E731
    data = clamp_limit(resource.RLIMIT_DATA, limits.memory_mb << 20)
    vmem = clamp_limit(resource.RLIMIT_AS, 2 * (limits.memory_mb << 20) + (512 << 20))
    parts = [f"ulimit -p {clamp_limit(resource.RLIMIT_NPROC, limits.max_procs)}",
             f"ulimit -d {kib(data)}", f"ulimit -v {kib(vmem)}", "ulimit -c 0",
             f"ulimit -f {clamp_limit(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES) // 512}",
             f"ulimit -n {clamp_limit(resource.RLIMIT_NOFILE, NOFILE_LIMIT)}",
             f"ulimit -St {cpu_soft}", f"ulimit -Ht {cpu_hard}", "printf x >&0"]
    source = "/dev/null" if stdin_fd is None else f"/proc/self/fd/{stdin_fd}"
    # The program runs as a child of sh (not exec'd) so that sh can report its CPU time ("times"):
    # bwrap's pid 1 exits before it is reaped, so our rusage of bwrap would miss it.
    return " && ".join(parts) + f'; "$@" 0<{source}; rc=$?; times >&0; exit $rc'


def build_argv(program: list[str], limits, *, host_dir: str, inner_uid: int, stdin_fd: int | None,
               isolation: str) -> tuple[list[str], list[int]]:
    """(argv, fds to pass) running `program` with cwd `host_dir` (seen inside as SANDBOX_CWD).

    The command must be started with the write end of the "started" pipe as its stdin (fd 0).
    Raises RuntimeError when the requested isolation is unavailable (one message naming what is
    missing and how to install it).
    """
    pass_fds = [] if stdin_fd is None else [stdin_fd]
    script = _ulimit_script(limits, stdin_fd)
    bwrap = find_bwrap()
    if bwrap is None:
        if isolation != "weak":
            raise RuntimeError(
                f"sandbox: bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated; install it "
                f"with `{INSTALL_HINT}`, or pass isolation='weak' to accept unshare + rlimits only")
        return _weak_argv(program, limits, host_dir, script), pass_fds
    root = os.geteuid() == 0
    args = list(_static_bwrap_args(bwrap, sandbox_python(), limits.network, root))
    tail = ["--"]
    if root:  # the program inherits this fd; it grants nothing (setns into its own namespace fails)
        ns_fd = holder_userns_fd()
        pass_fds.append(ns_fd)
        args[1:1] = ["--userns", str(ns_fd)]
        tail += ["setpriv", f"--reuid={inner_uid}", f"--regid={inner_uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all"]
    args += ["--bind", host_dir, SANDBOX_CWD, "--chdir", SANDBOX_CWD]
    return args + tail + ["/bin/sh", "-c", script, "sh", *program], pass_fds


def _weak_argv(program: list[str], limits, host_dir: str, script: str) -> list[str]:
    """util-linux unshare: new pid/net/ipc/uts/mount namespaces, rlimits; cwd is the host dir itself."""
    if shutil.which("unshare") is None:
        raise RuntimeError("sandbox: neither bubblewrap nor util-linux `unshare` is available; install "
                           f"bubblewrap with `{INSTALL_HINT}`")
    ns = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
    ns += [] if limits.network else ["--net"]
    ns += [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    env = ["env", "-i", *(f"{k}={v}" for k, v in environment(sandbox_python()).items())]
    return ns + ["--", *env, "/bin/sh", "-c", f"cd {shlex.quote(host_dir)} && {script}", "sh", *program]
