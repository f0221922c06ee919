"""The fork server that runs inside one persistent sandbox worker (standard library only; no JAX).

`envs.sandbox.fork_worker` starts this source as ``python -c <source> <socket fd> <config JSON>`` in the sandbox,
where nothing of the project is importable. It forks one child per task, then kills whatever the task left and
wipes `WIPE`, so the next task sees nothing of it. Protocol and guarantees: docs/sandbox.md.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys
import time

CWD = "/tmp/work"  # the task's working directory (launch.SANDBOX_CWD)
WIPE = ("/tmp/work", "/tmp", "/dev/shm")  # emptied after every task (entries on other filesystems are kept)
SETTLE_S = 2.0  # how long the leftovers of a task may take to die before the worker counts as dirty
_CATCHABLE = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]


def _prctl_dumpable(value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, value, 0, 0, 0)  # PR_SET_DUMPABLE


def _set_limits(lim: dict) -> None:
    """Soft = hard rlimits of the task (each clamped to the server's hard limit)."""
    def put(which, soft, hard=None):
        cap = resource.getrlimit(which)[1]
        clamp = (lambda v: v) if cap == resource.RLIM_INFINITY else (lambda v: min(v, cap))
        resource.setrlimit(which, (clamp(soft), clamp(soft if hard is None else hard)))

    mem = lim["memory_mb"] << 20
    put(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    put(resource.RLIMIT_DATA, mem)
    put(resource.RLIMIT_AS, 2 * mem + (512 << 20))
    put(resource.RLIMIT_FSIZE, lim["fsize"])
    put(resource.RLIMIT_NOFILE, lim["nofile"])
    put(resource.RLIMIT_CORE, 0)
    put(resource.RLIMIT_NPROC, lim["max_procs"])


def _run_python(script: str, args: list[str]) -> int:
    """Run `script` as ``python script args...`` would, in this (forked) interpreter; its exit status."""
    import atexit
    import builtins
    import threading
    import traceback
    import types

    path = os.path.join(CWD, script)
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)  # noqa: S102 - the sandboxed program itself
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - as the interpreter: print the traceback, exit 1
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _child(req: dict, fds: list[int], env: dict, handlers: dict) -> None:
    """In the forked child: isolate, limit, run; never returns."""
    code = 127
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        _prctl_dumpable(1)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        import atexit

        atexit._clear()
        os.chdir(CWD)
        os.environ.clear()
        os.environ.update(env)
        _set_limits(req["limits"])
        sys.stdin, sys.stdout = open(0, "r", closefd=False), open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        argv = req["argv"]
        if not req["python"]:
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as e:
                os.write(2, f"sandbox: cannot run {argv[0]!r}: {e.strerror}\n".encode())
                os._exit(127)
        code = _run_python(req["script"], req["args"])
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say
                pass
    except BaseException as e:  # noqa: BLE001 - the setup failed: say so on the task's stderr
        os.write(2, f"sandbox worker: task setup failed: {e!r}\n".encode(errors="replace"))
    finally:
        os._exit(code)


def _own_state() -> tuple:
    """What another process of this uid could change in the server and its next children would inherit:
    rlimits (prlimit), nice value, scheduling policy, CPU affinity."""
    limits = tuple(resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource)) if n.startswith("RLIMIT_"))
    return limits, os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0), frozenset(os.sched_getaffinity(0))


def _sweep(me: int) -> bool:
    """SIGKILL every other process of this uid in the namespace until none is left; False if one stays."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not others:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def _wipe(top: str, mode: int, skip: tuple[str, ...]) -> bool:
    """Delete every entry of `top` on its filesystem (not `skip`), restore its mode; False on failure."""
    try:
        dev, dirs, todo = os.lstat(top).st_dev, [], [top]
        while todo:
            d = todo.pop()
            if d != top:
                os.chmod(d, 0o700)
            elif os.lstat(d).st_mode & 0o7777 != mode:
                os.chmod(d, mode | 0o700)
            with os.scandir(d) as it:
                entries = list(it)
            for e in entries:
                st = e.stat(follow_symlinks=False)
                if e.path in skip or st.st_dev != dev:
                    continue
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                    dirs.append(e.path)
                else:
                    os.unlink(e.path)
        for d in reversed(dirs):
            os.rmdir(d)
        if os.lstat(top).st_mode & 0o7777 != mode:
            os.chmod(top, mode)
        for name in os.listxattr(top, follow_symlinks=False):  # user.* xattrs: a note for the next task
            os.removexattr(top, name, follow_symlinks=False)
        os.utime(top, follow_symlinks=False)  # times set by the task say nothing to the next one
        return True
    except OSError:
        return False


def _serve_one(sock: socket.socket, req: dict, fds: list[int], env: dict, handlers: dict, modes: dict) -> None:
    sock.send(b"S")  # before the fork: a task that kills us at once is the task's doing, not a failed start
    try:
        pid = os.fork()
    except OSError as e:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"error": f"fork failed: {e}"}).encode())
        return
    if pid == 0:
        _child(req, fds, env, handlers)
    for fd in fds:
        os.close(fd)
    import select

    pidfd, why = os.pidfd_open(pid), ""
    deadline = time.monotonic() + req["limits"]["wall_s"]
    with select.epoll() as ep:
        ep.register(pidfd, select.EPOLLIN)
        ep.register(sock.fileno(), select.EPOLLIN)
        while not why:
            ready = [fd for fd, _ in ep.poll(max(0.0, deadline - time.monotonic()))]
            if pidfd in ready:
                break
            if sock.fileno() in ready:
                why = "kill" if sock.recv(16) else "host gone"
            elif time.monotonic() >= deadline:
                why = "wall"
    os.close(pidfd)
    if why:
        os.kill(-1, signal.SIGKILL)  # the child and everything else but us
    _, status, usage = os.wait4(pid, 0)
    clean = _sweep(os.getpid())
    st = os.statvfs(CWD)
    clean = all([_wipe(d, modes[d], (CWD,)) for d in WIPE]) and clean and _own_state() == modes["state"]
    if why == "host gone":
        os._exit(0)
    sock.send(json.dumps({"rc": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime,
                          "why": why, "free_bytes": st.f_bavail * st.f_frsize, "free_inodes": st.f_favail,
                          "dirty": not clean}).encode())


def serve(sock_fd: int, config: dict) -> None:
    """Serve tasks over socket `sock_fd` until the host closes it (protocol: docs/sandbox.md)."""
    sock = socket.socket(fileno=sock_fd)
    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in _CATCHABLE}
    handlers = {s: h for s, h in handlers.items() if h is not None}
    for sig in handlers:
        signal.signal(sig, signal.SIG_IGN)
    _prctl_dumpable(0)
    modes = {d: os.stat(d).st_mode & 0o7777 for d in WIPE}
    modes["state"] = _own_state()
    for name in config.get("preload", ()):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module that cannot be imported here is imported by the task
            pass
    sock.send(b"R")
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not msg:
            return
        if msg == b"K":  # a kill the host sent as the last task ended by itself: stale
            continue
        _serve_one(sock, json.loads(msg), list(fds), env, handlers, modes)


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]))
