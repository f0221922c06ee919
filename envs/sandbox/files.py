"""Host-side writes and reads of a sandbox's working dir that never follow links the program planted (no JAX)."""
from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence


def open_dir_chain(root: str, parts: Sequence[str], uid: int, create: bool) -> int:
    """fd of root/parts..., refusing symlinks at every step (the program may have planted some)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def split_relpath(relpath: str) -> list[str]:
    if not isinstance(relpath, str) or not relpath or os.path.isabs(relpath):
        raise ValueError(f"sandbox file path must be a non-empty relative path, got {relpath!r}")
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"sandbox file path must stay inside the working dir, got {relpath!r}")
    return parts


def write_files(root: str, files: Mapping[str, str | bytes], uid: int) -> None:
    for relpath, content in files.items():
        *dirs, name = split_relpath(relpath)
        dfd = open_dir_chain(root, dirs, uid, create=True)
        try:
            try:  # replace whatever the program left there (a symlink must not redirect our write)
                if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
            os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
