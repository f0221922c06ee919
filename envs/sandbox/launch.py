"""Command lines that start one sandboxed program (private helper of `envs.sandbox`; no JAX).

``bwrap -> setpriv -> sh (rlimits, the "started" byte) -> program``, or unshare for `isolation="weak"`; the seccomp
filter, the uid slots and each sandbox's storage. The isolation they give, and why: docs/sandbox.md.
"""
from __future__ import annotations

import math
import os
import resource
import shlex
import shutil
import sys
import threading

from envs.sandbox import mounts
from envs.sandbox.holder import FIRST_SLOT_UID, MAX_SLOTS, UID_BASE, holder  # noqa: F401
from envs.sandbox.mounts import SANDBOX_CWD, SANDBOX_PACKAGES, SYSTEM_DIRS  # noqa: F401  (re-exported)

FILE_SIZE_LIMIT_BYTES = 128 << 20  # RLIMIT_FSIZE: largest file the program may write (also <= disk_mb)
NOFILE_LIMIT = 1024
FULL_SLACK_BYTES = 64 << 10  # a sandbox fs with less free space than this counts as full
INSTALL_HINT = "apt-get install -y bubblewrap"


def find_bwrap() -> str | None:
    """Path of the bubblewrap binary (env POSTTRAIN_BWRAP overrides; '' means "pretend missing")."""
    override = os.environ.get("POSTTRAIN_BWRAP")
    if override is not None:
        return override if override and os.access(override, os.X_OK) else None
    return shutil.which("bwrap")


def sandbox_python() -> str:
    """The interpreter of sandboxed Python programs: env POSTTRAIN_SANDBOX_PYTHON, else this one (it has numpy)."""
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


# ----------------------------------------------------------------------------- mounts
def _mount_args(network: bool, root: bool, disk_bytes: int) -> list[str]:
    """bwrap mount options that do not depend on the sandbox: system folders, /dev, /proc; /tmp and
    /dev/shm as sized tmpfs when not root (as root they come from the holder). The interpreter's
    mounts (`mounts.interpreter_args`) come after the sandbox's own storage, in `build_argv`."""
    args = [a for d in SYSTEM_DIRS for a in mounts.ro(d)] + ["--dev", "/dev", "--proc", "/proc"]
    if network:  # /etc/resolv.conf often points into /run
        args += mounts.ro("/run")
    if not root:
        for d in ("/tmp", "/dev/shm"):
            args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", d]
    return args


def environment(python: str) -> dict[str, str]:
    """The complete environment of the sandboxed program (nothing is inherited from the parent)."""
    bindir = os.path.dirname(python)
    return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MALLOC_ARENA_MAX": "2"}


_static_cache: dict[tuple, list[str]] = {}


def _static_bwrap_args(bwrap: str, python: str, network: bool, root: bool, disk_bytes: int) -> list[str]:
    key = (bwrap, python, network, root, disk_bytes, os.getpid())
    if key not in _static_cache:
        args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try"]
        args += [] if network else ["--unshare-net"]
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"] if root \
            else ["--unshare-user", "--disable-userns"]
        args += _mount_args(network, root, disk_bytes) + ["--clearenv"]
        for k, v in environment(python).items():
            args += ["--setenv", k, v]
        _static_cache[key] = args
    return _static_cache[key]


# ----------------------------------------------------------------------------- seccomp
# Denied (EPERM): calls that make state outliving the program (System V IPC, POSIX mqueues, keyrings) and any
# syscall of another ABI (x32, 32-bit compat); why: docs/sandbox.md.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, {"shmget": 29, "msgget": 68, "semget": 64, "mq_open": 240, "add_key": 248,
                                         "request_key": 249, "keyctl": 250}, 0x40000000),  # AUDIT_ARCH_X86_64, x32
                 "aarch64": (0xC00000B7, {"shmget": 194, "msgget": 186, "semget": 190, "mq_open": 180, "add_key": 217,
                                          "request_key": 218, "keyctl": 219}, None)}
_BPF_LD_ABS, _BPF_JEQ, _BPF_JGE, _BPF_RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, RET|K
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM


def seccomp_program(machine: str | None = None) -> bytes | None:
    """bwrap ``--seccomp`` filter (classic BPF, linux/filter.h) denying the calls above; None on an unlisted arch."""
    import platform
    import struct

    table = _SECCOMP_ARCH.get(machine or platform.machine())
    if table is None:
        return None
    arch, calls, abi_bit = table
    deny = [_BPF_JGE, abi_bit] if abi_bit else []
    body = [(_BPF_JEQ, nr) for nr in calls.values()] + ([tuple(deny)] if deny else [])
    n = len(body)
    insns = [(_BPF_LD_ABS, 0, 0, 4), (_BPF_JEQ, 0, n + 2, arch), (_BPF_LD_ABS, 0, 0, 0)]
    insns += [(op, n - i, 0, k) for i, (op, k) in enumerate(body)]  # match -> jump to the EPERM return
    insns += [(_BPF_RET, 0, 0, _RET_ALLOW), (_BPF_RET, 0, 0, _RET_EPERM)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)


def seccomp_fd() -> int | None:
    """A memfd holding `seccomp_program()` at offset 0 (close it after the sandbox started), or None."""
    program = seccomp_program()
    if program is None:
        return None
    fd = os.memfd_create("sandbox-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
             f"ulimit -f {clamp_limit(resource.RLIMIT_FSIZE, min(FILE_SIZE_LIMIT_BYTES, limits.disk_mb << 20)) // 512}",
             f"ulimit -n {clamp_limit(resource.RLIMIT_NOFILE, NOFILE_LIMIT)}",
             f"ulimit -St {cpu_soft}", f"ulimit -Ht {cpu_hard}", "printf x >&0"]
    source = "/dev/null" if stdin_fd is None else f"/proc/self/fd/{stdin_fd}"
    # The program runs as a child of sh (not exec'd) so that sh can report its CPU time ("times"):
    # bwrap's pid 1 exits before it is reaped, so our rusage of bwrap would miss it.
    return " && ".join(parts) + f'; "$@" 0<{source}; rc=$?; times >&0; exit $rc'


def prepare_storage(host_dir: str, inner_uid: int, disk_bytes: int) -> tuple[str, str | None]:
    """Give sandbox dir `host_dir` its storage: (working dir as the host sees it, root of the capped fs or None).

    As root with bubblewrap, a tmpfs of `disk_bytes` in the holder's mount namespace; otherwise `host_dir` itself (no
    total cap). Raises OSError or RuntimeError when the holder cannot mount.
    """
    if os.geteuid() != 0 or find_bwrap() is None:
        return host_dir, None
    h = holder()
    h.mount_tmpfs(host_dir, disk_bytes, inner_uid)
    return h.view(host_dir) + "/work", h.view(host_dir)


def disk_full(fs_root: str | None) -> bool:
    """Whether the sandbox's capped fs (cwd + /tmp + /dev/shm) has (almost) no space or inodes left.

    Read after the run, so it misses a program that filled the fs and freed it on exit; `run` counts SIGBUS too.
    """
    if fs_root is None:
        return False
    try:
        st = os.statvfs(fs_root)
    except OSError:
        return False
    return fs_is_full(st.f_bavail * st.f_frsize, st.f_favail)


def fs_is_full(free_bytes: int, free_inodes: int) -> bool:
    """Whether a sandbox fs with `free_bytes` bytes and `free_inodes` inodes left counts as full."""
    return free_bytes < FULL_SLACK_BYTES or free_inodes < 16  # bytes or inodes used up


def build_argv(program: list[str], limits, *, host_dir: str, work_dir: str, inner_uid: int, stdin_fd: int | None,
               isolation: str, holder_fs: bool, seccomp: int | None = None) -> tuple[list[str], list[int]]:
    """(argv, fds to pass) running `program` in sandbox dir `host_dir`, whose `work_dir` is seen as SANDBOX_CWD.

    Start the command with the write end of the "started" pipe as its stdin (fd 0). `holder_fs`: whether host_dir has
    the holder's tmpfs; `seccomp`: an fd from `seccomp_fd`. Raises RuntimeError when the isolation is unavailable (one
    message naming what is missing and how to install it).
    """
    pass_fds = [] if stdin_fd is None else [stdin_fd]
    script = _ulimit_script(limits, stdin_fd)
    if find_bwrap() is None:
        if isolation != "weak":
            raise RuntimeError(
                f"sandbox: bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated; install it "
                f"with `{INSTALL_HINT}`, or pass isolation='weak' to accept unshare + rlimits only")
        return _weak_argv(program, limits, work_dir, script), pass_fds
    args, more_fds = bwrap_prefix(limits.network, limits.disk_mb, host_dir=host_dir, inner_uid=inner_uid,
                                  holder_fs=holder_fs, seccomp=seccomp)
    return args + ["/bin/sh", "-c", script, "sh", *program], pass_fds + more_fds


def bwrap_prefix(network: bool, disk_mb: int, *, host_dir: str, inner_uid: int, holder_fs: bool,
                 seccomp: int | None = None) -> tuple[list[str], list[int]]:
    """(argv up to the sandboxed command, fds to pass) of a strict sandbox in `host_dir` (see `build_argv`).

    bwrap with its namespaces, mounts and environment and, as root, setpriv to `inner_uid`; shared with the persistent
    workers. Raises RuntimeError when bubblewrap is missing or, as root, `host_dir` has no `prepare_storage` storage.
    """
    bwrap = find_bwrap()
    if bwrap is None:
        raise RuntimeError(f"sandbox: bubblewrap (bwrap) is not installed; install it with `{INSTALL_HINT}`")
    root = os.geteuid() == 0
    if root and not holder_fs:
        raise RuntimeError(f"sandbox: {host_dir} has no storage from prepare_storage (bwrap appeared after it?)")
    python = sandbox_python()
    args, pass_fds = list(_static_bwrap_args(bwrap, python, network, root, disk_mb << 20)), []
    tail = ["--"]
    if root:  # the program inherits the userns fd; it grants nothing (setns into its own namespace fails)
        h = holder()
        pass_fds.append(h.userns_fd)
        args[1:1] = ["--userns", str(h.userns_fd)]
        args[:0] = ["nsenter", f"--mount=/proc/{h.pid}/ns/mnt", "--"]
        tail += ["setpriv", f"--reuid={inner_uid}", f"--regid={inner_uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all"]
        args += ["--bind", f"{host_dir}/tmp", "/tmp", "--bind", f"{host_dir}/shm", "/dev/shm",
                 "--bind", f"{host_dir}/work", SANDBOX_CWD]
    else:
        args += ["--bind", host_dir, SANDBOX_CWD]
    args += [*mounts.interpreter_args(python), "--remount-ro", "/", "--chdir", SANDBOX_CWD]
    if seccomp is not None:
        pass_fds.append(seccomp)
        args += ["--seccomp", str(seccomp)]
    return args + tail, pass_fds


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
