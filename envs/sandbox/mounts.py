"""What of the host a sandbox sees, read-only at its own paths (private helper of `envs.sandbox`; no JAX).

The system folders `SYSTEM_DIRS` and the interpreter (`interpreter_args`: its base installation, executable, a
venv's links and, of site-packages, only `SANDBOX_PACKAGES`), each bound at its host path; what cannot be shown
raises one line naming it (`check_visible`). The rules and why: docs/sandbox.md.
"""
from __future__ import annotations

import functools
import os
import site
import stat
import sys
from typing import NoReturn

from envs.sandbox.holder import FIRST_SLOT_UID, MAX_SLOTS, UID_BASE

SANDBOX_CWD = "/tmp/work"  # the working directory as the sandboxed program sees it
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # bound read-only
SANDBOX_PACKAGES = ("numpy",)  # site-packages entries (distributions) a sandboxed Python program can import
_SYSTEM = tuple(d + "/" for d in SYSTEM_DIRS)
_TOP_BYTES = 1 << 20  # size of the read-only tmpfs under a storage mount that holds mount points
_ARITY = {"--ro-bind": 3, "--bind": 3, "--symlink": 3, "--tmpfs": 2, "--dir": 2, "--perms": 2}


def ro(path: str) -> list[str]:
    """bwrap args that show `path` read-only as on the host (a symlink stays a symlink; nothing if absent)."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind", path, path] if os.path.exists(path) else []


def package_entries(site_dir: str) -> list[str]:
    """Entries of site-packages dir `site_dir` that belong to SANDBOX_PACKAGES (module, dist-info, .libs)."""
    wanted = {p.lower().replace("-", "_") for p in SANDBOX_PACKAGES}
    out = []
    for name in sorted(os.listdir(site_dir)):
        stem = name.lower().split("-")[0].removesuffix(".libs").removesuffix(".py")
        if stem in wanted and (name.endswith((".dist-info", ".libs", ".py")) or "-" not in name):
            out.append(os.path.join(site_dir, name))
    return out


def _outside_system(path: str) -> bool:
    return not (path + "/").startswith(_SYSTEM)


def _python_mounts(python: str) -> list[str]:
    """bwrap args showing interpreter `python`: its prefix read-only, of site-packages only SANDBOX_PACKAGES."""
    if python != sys.executable:  # another interpreter: its installation dir as a whole
        tops = {os.path.dirname(os.path.dirname(p)) for p in (python, os.path.realpath(python))}
        return [a for t in sorted(tops) if _outside_system(t) for a in ro(t)]
    base = os.path.realpath(sys.base_prefix)
    args = ro(base) if _outside_system(base) else []
    executable = os.path.realpath(python)
    if _outside_system(executable) and not executable.startswith(base + "/"):
        args += ro(executable)
    # each site dir at its real path and at the path Python computes from sys.prefix (a venv reached through a
    # symlinked directory imports from the unresolved path)
    sites = {(os.path.realpath(p), os.path.abspath(p)) for p in site.getsitepackages() if os.path.isdir(p)}
    for site_dir, seen_as in sorted(sites):
        if not _outside_system(site_dir) or site_dir.startswith(base + "/"):
            args += ["--tmpfs", site_dir]  # hide the base install's own packages
        for entry in package_entries(site_dir):
            args += ["--ro-bind", entry, entry]
            if seen_as != site_dir:
                args += ["--ro-bind", entry, os.path.join(seen_as, os.path.relpath(entry, site_dir))]
    if sys.prefix != sys.base_prefix:  # a venv: its config and interpreter links, nothing else
        args += ro(os.path.join(sys.prefix, "pyvenv.cfg"))
        bindir = os.path.join(sys.prefix, "bin")
        args += [a for n in sorted(os.listdir(bindir)) if n.startswith("python") for a in ro(os.path.join(bindir, n))]
    return args


@functools.lru_cache(maxsize=8)
def interpreter_args(python: str, storage: tuple[str, ...] = ("/tmp", "/dev/shm")) -> tuple[str, ...]:
    """bwrap args showing interpreter `python` at its host paths, to come after the sandbox's `storage` mounts.

    Each top folder they land in under a storage mount first gets a fresh read-only tmpfs, so nothing is made in the
    sandbox's storage. Raises RuntimeError (`check_visible`) when a part cannot be shown to the sandbox user.
    """
    args = _python_mounts(python)
    check_visible([args[i + 1] for i, a in enumerate(args) if a == "--ro-bind"])
    dests = [args[i + _ARITY[a] - 1] for i, a in enumerate(args) if a in ("--ro-bind", "--symlink", "--tmpfs")]
    tops = sorted({d + "/" + p[len(d) + 1:].split("/")[0] for p in dests for d in storage if p.startswith(d + "/")})
    fresh = [a for top in tops for a in ("--perms", "0755", "--size", str(_TOP_BYTES), "--tmpfs", top)]
    return (*fresh, *with_parents(args, made=tops), *(a for top in tops for a in ("--remount-ro", top)))


def with_parents(args: list[str], made: list[str] = ()) -> list[str]:
    """`args` with ``--perms 0755 --dir`` for every missing ancestor of a mount or symlink target.

    bwrap would make them mode 0700, which the sandbox user cannot traverse. Skips `made` (and their ancestors);
    `args` holds no ``--perms``.
    """
    out, i = [], 0
    made = {"/", *SYSTEM_DIRS, *(p for m in made for p in _ancestors_and_self(m))}
    while i < len(args):
        n = _ARITY.get(args[i], 1)
        for parent in _ancestors_and_self(os.path.dirname(args[i + n - 1])) if n > 1 else ():
            if parent not in made:
                made.add(parent)
                out += ["--perms", "0755", "--dir", parent]
        out += args[i:i + n]
        i += n
    return out


def _ancestors_and_self(path: str) -> list[str]:
    """"/a/b/c" -> ["/a", "/a/b", "/a/b/c"] ("/" -> [])."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _mapped(host_id: int) -> bool:
    """Whether host uid/gid `host_id` is mapped in the holder's user namespace."""
    return host_id == 0 or UID_BASE + FIRST_SLOT_UID <= host_id < UID_BASE + FIRST_SLOT_UID + MAX_SLOTS


def _bwrap_enters(st: os.stat_result) -> bool:
    """Whether bwrap (uid/gid 0 of the holder's user namespace, capabilities over inodes whose owner and
    group are both mapped there) may search the directory with stat `st`."""
    mode = st.st_mode
    return bool(mode & stat.S_IXOTH or (st.st_uid == 0 and mode & stat.S_IXUSR)
                or (st.st_gid == 0 and mode & stat.S_IXGRP) or (_mapped(st.st_uid) and _mapped(st.st_gid)))


def _sandbox_reads(path: str, st: os.stat_result, root: bool) -> bool:
    """Whether the sandbox user may read `path` (and search it, for a directory)."""
    is_dir = stat.S_ISDIR(st.st_mode)
    if not root:  # the sandbox user is the caller's uid
        return os.access(path, os.R_OK | (os.X_OK if is_dir else 0))
    bits = stat.S_IROTH | (stat.S_IXOTH if is_dir else 0)
    return st.st_mode & bits == bits


def _refuse(path: str, why: str) -> NoReturn:
    raise RuntimeError(f"sandbox: cannot show the interpreter's environment inside the sandbox: {path} {why}; "
                       "install it where the sandbox user can read it, or set POSTTRAIN_SANDBOX_PYTHON to an "
                       "interpreter installed elsewhere")


def check_visible(paths: list[str]) -> None:
    """Raise RuntimeError naming the path and why unless each of `paths` can be bound at its path and read inside."""
    root = os.geteuid() == 0
    for path in paths:
        if path == SANDBOX_CWD or path.startswith(SANDBOX_CWD + "/"):
            _refuse(path, f"lies inside the sandbox's working directory {SANDBOX_CWD}")
        parent = os.path.dirname(path)
        while root and parent != "/":
            st = os.stat(parent)
            if not _bwrap_enters(st):
                _refuse(path, f"is under {parent} (mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}), "
                              "which bubblewrap cannot enter")
            parent = os.path.dirname(parent)
        try:
            st = os.stat(path)
        except OSError as e:
            _refuse(path, f"cannot be read ({e.strerror})")
        if not _sandbox_reads(path, st, root):
            _refuse(path, f"is not readable by the sandbox user (mode {st.st_mode & 0o7777:04o}, "
                          f"owner uid {st.st_uid})")
