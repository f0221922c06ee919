"""One persistent sandbox worker, host side (private helper of `envs.sandbox.workers`; no JAX).

`Worker` runs the fork server (`envs.sandbox.forkserver`) in one strict sandbox and one task at a time in it,
capping the task's output and memory; a worker that cannot be trusted any more is closed (`dead`) for its pool to
replace. Design and protocol: docs/sandbox.md.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from envs import sandbox
from envs.sandbox import files as sbx_files
from envs.sandbox import forkserver, launch, procs

BACKSTOP_S = 3.0  # seconds past a task's wall time after which the host kills its worker
START_TIMEOUT_S = 30.0  # bound on a worker's start (bwrap + interpreter + preload), seconds
_SERVER_SOURCE = Path(forkserver.__file__).read_text(encoding="utf-8")  # run inside as python -c


class _Gone(Exception):
    """The worker died before the program started (the pool retries on a fresh one)."""


# ----------------------------------------------------------------------------- spawner
_spawner: tuple[int, queue.SimpleQueue] | None = None
_spawner_lock = threading.Lock()


def _spawn_loop(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, box, done = jobs.get()
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))
        done.set()


def _in_spawner(fn):
    """fn() on this process's long-lived spawner thread (so bwrap's parent thread outlives the worker)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_spawn_loop, args=(jobs,), daemon=True, name="sandbox-spawner").start()
            _spawner = (os.getpid(), jobs)
        jobs = _spawner[1]
    box, done = [], threading.Event()
    jobs.put((fn, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


# ----------------------------------------------------------------------------- one worker
class Worker:
    """One persistent sandbox running the fork server. Raises RuntimeError/OSError when it cannot start."""

    def __init__(self, *, disk_mb: int, network: bool, preload: tuple[str, ...]) -> None:
        self.disk_mb, self.network, self.dead = disk_mb, network, False
        self.uid = launch.SLOTS.acquire()
        self.host_dir, self.tree, self.proc, self.sock = None, None, None, None
        try:
            self._start(preload)
        except BaseException:
            self.close()
            raise

    def _start(self, preload: tuple[str, ...]) -> None:
        self.host_dir = procs.make_dir(launch.host_uid(self.uid))
        self.work, self.fs_root = launch.prepare_storage(self.host_dir, self.uid, self.disk_mb << 20)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seccomp = launch.seccomp_fd()
        try:
            prefix, fds = launch.bwrap_prefix(self.network, self.disk_mb, host_dir=self.host_dir, inner_uid=self.uid,
                                              holder_fs=self.fs_root is not None, seccomp=seccomp)
            config = json.dumps({"preload": list(preload)})
            cmd = prefix + ["/bin/sh", "-c", 'ulimit -c 0 && exec "$@"', "sh", sandbox.PYTHON, "-c", _SERVER_SOURCE,
                            str(theirs.fileno()), config]

            def spawn():
                with procs.LOCK:
                    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, pass_fds=[*fds, theirs.fileno()],
                                            start_new_session=True, env={"PATH": "/usr/bin:/bin"})
                    return proc, procs.register(proc.pid)

            self.proc, self.tree = _in_spawner(spawn)
        finally:
            theirs.close()
            if seccomp is not None:
                os.close(seccomp)
        self.sock.settimeout(START_TIMEOUT_S)
        try:
            ready = self.sock.recv(16)
        except OSError:
            ready = b""
        if ready != b"R":
            self.proc.kill()
            err = self.proc.stderr.read().decode(errors="replace").strip()
            raise RuntimeError(f"sandbox worker did not start: {err[-500:] or 'no answer'}")
        self.sock.settimeout(None)
        self.proc.stderr.close()
        self.tree.find_init()
        servers = procs._children(self.tree.init_pid) if self.tree.init_pid else []
        self.server_pid = servers[0] if servers else 0
        self.tree.expected, self.tree.dirs = tuple(servers), (self.host_dir,)

    def run(self, files, argv: list[str], limits: sandbox.Limits, stdin: str | None, t0: float) -> sandbox.SandboxResult:
        """Run one task (protocol: docs/sandbox.md). Raises _Gone when the worker died before it started."""
        try:
            sbx_files.write_files(self.work, files, launch.host_uid(self.uid))
        except OSError as e:
            self.dead = True
            raise _Gone(f"could not write program files: {e}") from None
        python = len(argv) in (2, 3) and argv[0] == sandbox.PYTHON and argv[1:-1] in ([], ["-S"]) \
            and argv[-1].endswith(".py")
        cpu = max(1, -(-limits.cpu_s // 1))
        req = {"argv": argv, "python": python, "script": argv[-1], "args": [],
               "limits": {"cpu_s": int(cpu), "wall_s": limits.wall_s, "memory_mb": limits.memory_mb,
                          "max_procs": limits.max_procs, "nofile": launch.NOFILE_LIMIT,
                          "fsize": min(launch.FILE_SIZE_LIMIT_BYTES, limits.disk_mb << 20)}}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin_fd = os.memfd_create("sandbox-stdin")
        try:
            os.write(stdin_fd, (stdin or "").encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            try:
                socket.send_fds(self.sock, [json.dumps(req).encode()], [stdin_fd, out_w, err_w])
            except OSError as e:
                self.dead = True
                raise _Gone(f"sandbox worker is gone: {e}") from None
        finally:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
        try:
            return self._collect(out_r, err_r, limits, t0)
        finally:
            os.close(out_r), os.close(err_r)

    def _collect(self, out_r: int, err_r: int, limits: sandbox.Limits, t0: float) -> sandbox.SandboxResult:
        import selectors

        bufs, cap, why, started, reply = {out_r: bytearray(), err_r: bytearray()}, limits.max_output_bytes, "", False, None
        backstop, next_poll = t0 + limits.wall_s + BACKSTOP_S, time.monotonic() + sandbox.MEMORY_POLL_S
        with selectors.DefaultSelector() as sel:
            for fd in (out_r, err_r, self.sock.fileno()):
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            while reply is None or sel.get_map():
                now = time.monotonic()
                if now >= backstop:
                    why = why or "wall"
                    break
                if started and reply is None and not why and now >= next_poll:
                    next_poll = now + sandbox.MEMORY_POLL_S
                    if self.tree.memory_bytes(frozenset({self.tree.init_pid, self.server_pid})) > limits.memory_mb << 20:
                        why = self._kill_task("memory")
                for key, _ in sel.select(max(0.0, min(backstop, next_poll) - now)):
                    if key.fd == self.sock.fileno():
                        msg = self._recv()
                        if msg is None:
                            continue
                        if not msg:  # the server died (the task killed it, or kill_all)
                            sel.unregister(key.fd)
                            reply = {}
                        elif msg == b"S":
                            started = True
                        else:
                            reply = json.loads(msg)
                            sel.unregister(key.fd)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    buf = bufs[key.fd]
                    buf += data[: cap + 1 - len(buf)]
                    if len(buf) > cap:
                        del buf[cap:]
                        why = why or self._kill_task("output")
        return self._result(reply, why, started, bytes(bufs[out_r]), bytes(bufs[err_r]), limits, t0)

    def _recv(self) -> bytes | None:
        try:
            return self.sock.recv(1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _kill_task(self, why: str) -> str:
        try:
            self.sock.send(b"K")
        except OSError:
            pass
        return why

    def _result(self, reply, why, started, out, err, limits, t0) -> sandbox.SandboxResult:
        wall = time.monotonic() - t0
        if not reply:  # None: no answer by the backstop (the task stopped its server); {}: the server died
            killed = self.close()
            if not started:
                raise _Gone("sandbox worker died before the program started")
            if killed:
                return sandbox._classify(limits, started=True, why="", killed=True, rc=137, stdout=out, stderr=err,
                                         wall=wall, cpu=0.0)
            why = why or ("wall" if reply is None else "")
            reply = {"rc": -signal.SIGKILL, "cpu_s": 0.0, "why": "", "free_bytes": 1 << 30, "free_inodes": 1 << 20}
        elif "error" in reply:
            return sandbox._infra(f"sandbox worker: {reply['error']}", t0)
        elif reply.get("dirty"):
            self.close()
        rc = reply["rc"] if reply["rc"] >= 0 else 128 - reply["rc"]
        why = why or ("wall" if reply["why"] == "wall" else "")
        capped = self.fs_root is not None
        full = capped and launch.fs_is_full(reply["free_bytes"], reply["free_inodes"])
        return sandbox._classify(limits, started=True, why=why, killed=False, rc=rc, stdout=out, stderr=err,
                                 wall=wall, cpu=reply["cpu_s"], disk_full=full or (capped and rc == 128 + signal.SIGBUS))

    def forget(self) -> None:
        """In a forked child: drop this (the parent's) worker, closing only our copies of its fds."""
        for closer in (self.sock, self.tree):
            if closer is not None:
                closer.close()
        self.sock, self.tree, self.proc, self.host_dir, self.uid, self.dead = None, None, None, None, None, True

    def close(self) -> bool:
        """Kill the sandbox, remove its dir, free its uid (idempotent); True if kill_all had killed it."""
        killed = False
        if self.tree is not None:
            self.tree.kill()
            self.proc.wait()
            self.tree.wait_init_gone()
            killed = procs.unregister(self.tree)
            self.tree.close()
            self.tree = None
        if self.proc is not None and self.proc.stderr and not self.proc.stderr.closed:
            self.proc.stderr.close()
        if self.sock is not None:
            self.sock.close()
        if self.host_dir is not None:
            procs.remove_dir(self.host_dir)
            self.host_dir = None
        if self.uid is not None:
            launch.SLOTS.release(self.uid)
            self.uid = None
        self.dead = True
        return killed
