"""The holder: one user + mount namespace per host process, kept while it runs (root mode only; no JAX).

Private helper of `envs.sandbox`: bwrap joins its user namespace and starts in its mount namespace, where each
sandbox's writable storage is one tmpfs (`Holder.mount_tmpfs`). Uid maps and lifetime: docs/sandbox.md.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time

UID_BASE = 1_700_000_000  # inner uid FIRST_SLOT_UID+k of the holder namespace is host uid UID_BASE+FIRST_SLOT_UID+k
FIRST_SLOT_UID = 10_000  # no /etc/passwd entry, so tools print a bare number
MAX_SLOTS = 60_000
SUBDIRS = ("work", "tmp", "shm")  # on each sandbox's tmpfs: cwd, /tmp, /dev/shm as the program sees them

# Runs as root of the new namespaces once the uid maps exist (the second exec gives it full
# capabilities there): disable nested user namespaces, then mount one tmpfs per request line
# "<size bytes> <uid> <path>" and answer "rc=<status>" (mount's error text before it, if any).
_LOOP = ("echo 0 > /proc/sys/user/max_user_namespaces && echo ok || exit 1\n"
         "while read -r size uid dir; do\n"
         "  mount -t tmpfs -o \"size=$size,nr_inodes=$((size / 4096)),mode=0755,uid=$uid,gid=$uid,nosuid,nodev\" \\\n"
         "    posttrain-sbx \"$dir\" 2>&1\n"
         "  echo \"rc=$?\"\n"
         "done\n")


class Holder:
    """A live holder process: `pid`, `userns_fd` (O_CLOEXEC; pass it to bwrap), `mount_tmpfs`."""

    def __init__(self) -> None:
        script = f"read x; exec /bin/sh -c {shlex.quote(_LOOP)}"
        try:
            self.proc = subprocess.Popen(["unshare", "--user", "--mount", "--propagation", "private", "--",
                                          "/bin/sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
        except OSError as e:
            raise RuntimeError(f"sandbox: cannot start util-linux `unshare` ({e})") from e
        self.pid, self._lock = self.proc.pid, threading.Lock()
        try:
            mine, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + 10.0
            while os.readlink(f"/proc/{self.pid}/ns/user") == mine:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sandbox: `unshare --user --mount` failed: " + self._stderr())
                time.sleep(0.0005)
            ids = f"0 0 1\n{FIRST_SLOT_UID} {UID_BASE + FIRST_SLOT_UID} {MAX_SLOTS}\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{self.pid}/{name}", "w") as f:
                    f.write(ids)
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.flush()
            if self.proc.stdout.readline() != b"ok\n":
                raise RuntimeError("sandbox: cannot disable nested user namespaces: " + self._stderr())
            self.userns_fd = os.open(f"/proc/{self.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def _stderr(self) -> str:
        self.proc.kill()
        return self.proc.stderr.read().decode(errors="replace").strip()

    def mount_tmpfs(self, path: str, size_bytes: int, inner_uid: int) -> None:
        """Mount a `size_bytes` tmpfs owned by `inner_uid`, with SUBDIRS, on `path` in the holder's namespace.

        Raises OSError when the mount fails.
        """
        if any(c in path for c in "\n\r"):
            raise OSError(f"sandbox dir path has a line break: {path!r}")
        with self._lock:
            try:
                self.proc.stdin.write(f"{size_bytes} {inner_uid} {path}\n".encode())
                self.proc.stdin.flush()
                lines = []
                while not (line := self.proc.stdout.readline()).startswith(b"rc=") and line:
                    lines.append(line.decode(errors="replace").strip())
            except (OSError, ValueError) as e:
                raise OSError(f"sandbox holder is gone: {e}") from None
        if line != b"rc=0\n":
            raise OSError(f"could not mount the sandbox tmpfs on {path}: {' '.join(lines) or line!r}")
        root = self.view(path)
        for name in SUBDIRS:
            os.mkdir(os.path.join(root, name), 0o700)
            os.chown(os.path.join(root, name), UID_BASE + inner_uid, UID_BASE + inner_uid)

    def view(self, path: str) -> str:
        """The host path under which the holder's namespace shows `path` (for root on the host)."""
        return f"/proc/{self.pid}/root{path}"

    def close(self) -> None:
        """End the holder (its namespaces go away with the last sandbox that uses them)."""
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        self.proc.kill()
        self.proc.wait()
        if getattr(self, "userns_fd", None) is not None:
            os.close(self.userns_fd)
            self.userns_fd = None


_lock = threading.Lock()
_holder: tuple[int, Holder] | None = None  # (owner pid, holder)


def holder() -> Holder:
    """This process's Holder, started on first use (a forked child starts its own).

    Raises RuntimeError if user or mount namespaces cannot be created or configured here.
    """
    global _holder
    with _lock:
        if _holder is None or _holder[0] != os.getpid() or _holder[1].proc.poll() is not None:
            _holder = (os.getpid(), Holder())
        return _holder[1]
