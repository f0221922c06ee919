"""One RepoFix-v0 episode's workspace (an `envs.sandbox.Workspace`) and the tools acting on it (`Session.execute`).

Commands run in the sandbox; file tools read host-side (no symlink followed) and write through a sandbox run,
whose file writer replaces a planted symlink instead of following it.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import stat
import time
import weakref

from envs import base, sandbox
from envs.tasks.repo_fix import patch as patch_lib
from envs.tasks.repo_fix.tools import ToolCall

MAX_SNAPSHOT_FILES = 2000
MAX_FILE_BYTES = 1 << 20
MAX_SNAPSHOT_BYTES = 16 << 20
MAX_LISTED = 300
MAX_WRITE_BYTES = 1 << 20  # one write_file / apply_patch
SKIP_DIRS = frozenset({"__pycache__", ".git"})


class InfraError(RuntimeError):
    """The sandbox could not set up or run a tool (not the model's fault)."""


def _norm(path: str) -> str:
    """A workspace-relative path; raises ValueError when it is absolute or leaves the workspace."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("the path is empty")
    clean = posixpath.normpath(path.strip().removeprefix("./"))
    if os.path.isabs(clean) or clean == ".." or clean.startswith("../"):
        raise ValueError(f"{path!r} is outside the repository (use a path relative to its root)")
    return clean


class Session:
    """The workspace of one episode, holding `files` at the start. Raises InfraError when it cannot be set up."""

    def __init__(self, files: dict[str, str], *, run_limits: sandbox.Limits, max_output_chars: int,
                 isolation: str = "strict") -> None:
        self.run_limits, self.max_output_chars, self.isolation = run_limits, max_output_chars, isolation
        self.workspace = sandbox.Workspace(disk_mb=run_limits.disk_mb)
        self.workspace.__enter__()
        self._finalizer = weakref.finalize(self, self.workspace.close)  # a dropped session frees its workspace
        try:
            self.write(files)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the workspace (idempotent)."""
        self._finalizer()

    # -- file access ---------------------------------------------------------------------------------------
    def read(self, path: str) -> str | None:
        """Text of workspace file `path`, or None when it is missing or not a regular file."""
        try:
            return self.workspace.read_text(_norm(path), MAX_FILE_BYTES)
        except (OSError, ValueError):
            return None

    def write(self, files: dict[str, str | bytes], delete: tuple[str, ...] = ()) -> None:
        """Write `files` and delete `delete` in one sandbox run.

        Raises ValueError over MAX_WRITE_BYTES, InfraError when the sandbox fails."""
        size = sum(len(t.encode() if isinstance(t, str) else t) for t in files.values())
        if size > MAX_WRITE_BYTES:
            raise ValueError(f"{size} bytes to write, more than the {MAX_WRITE_BYTES} one call may write")
        argv = ["rm", "-rf", "--", *delete] if delete else ["true"]
        result = sandbox.run(dict(files), argv, limits=self.run_limits, workspace=self.workspace,
                             isolation=self.isolation)
        if result.status == "infra_error":
            raise InfraError(f"RepoFix: could not write to the workspace: {result.reason}")

    def walk(self) -> list[str]:
        """Regular files of the workspace (relative paths, sorted; symlinks are never followed, caches skipped)."""
        root = str(self.workspace.path)
        out = []
        for current, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in names:
                full = os.path.join(current, name)
                if stat.S_ISREG(os.lstat(full).st_mode):
                    out.append(os.path.relpath(full, root).replace(os.sep, "/"))
            if len(out) > MAX_SNAPSHOT_FILES:
                break
        return sorted(out)

    def snapshot(self) -> dict[str, bytes]:
        """{path: bytes} of the workspace's regular files; what is over MAX_FILE_BYTES or MAX_SNAPSHOT_* is left out."""
        out, total = {}, 0
        for path in self.walk()[:MAX_SNAPSHOT_FILES]:
            try:
                data = self.workspace.read_bytes(path, MAX_FILE_BYTES + 1)
            except (OSError, ValueError):
                continue
            if len(data) <= MAX_FILE_BYTES and total + len(data) <= MAX_SNAPSHOT_BYTES:
                out[path] = data
                total += len(data)
        return out

    # -- tools ------------------------------------------------------------------------------------------------
    def execute(self, call: ToolCall) -> str:
        """The observation text of one tool call (submit is the env's business). Raises InfraError only."""
        try:
            return getattr(self, "_" + call.name)(**call.arguments)
        except (ValueError, patch_lib.PatchError) as exc:
            return f"error: {exc}"

    def _list_files(self, path: str = "") -> str:
        top = "" if path.strip() in ("", ".", "./") else _norm(path)
        listing = [p for p in self.walk() if not top or p.startswith(top + "/")]
        if not listing:
            return f"error: no files under {path!r}" if top else "(no files)"
        more = f"\n... and {len(listing) - MAX_LISTED} more" if len(listing) > MAX_LISTED else ""
        return "\n".join(listing[:MAX_LISTED]) + more

    def _read_file(self, path: str) -> str:
        text = self.read(_norm(path))
        if text is None:
            return f"error: no file {path!r} (list_files shows the files)"
        return base.cap_text(text, self.max_output_chars)

    def _write_file(self, path: str, content: str) -> str:
        self.write({_norm(path): content})
        return f"wrote {_norm(path)} ({len(content)} characters)"

    def _apply_patch(self, patch: str) -> str:
        changes = {_norm(p): t for p, t in patch_lib.apply(patch, self.read).items()}
        deleted = tuple(p for p, t in changes.items() if t is None)
        self.write({p: t for p, t in changes.items() if t is not None}, deleted)
        return "applied: " + ", ".join(f"{p} ({'deleted' if t is None else 'updated'})" for p, t in changes.items())

    def _run(self, command: str, timeout_s: float | None = None) -> str:
        wall = self.run_limits.wall_s if timeout_s is None else min(max(float(timeout_s), 1.0), self.run_limits.wall_s)
        limits = dataclasses.replace(self.run_limits, wall_s=wall, cpu_s=min(self.run_limits.cpu_s, wall))
        started = time.monotonic()
        result = sandbox.run({}, ["bash", "-c", command], limits=limits, workspace=self.workspace,
                             isolation=self.isolation)
        if result.status == "infra_error":
            raise InfraError(f"RepoFix: the sandbox could not run a command: {result.reason}")
        text = base.cap_text(result.stdout + result.stderr, self.max_output_chars)
        note = "" if result.status in ("ok", "runtime_error") else f" [{result.status}: {result.reason}]"
        return f"{text.rstrip()}\n[exit code {result.returncode}, {time.monotonic() - started:.1f} s]{note}"
