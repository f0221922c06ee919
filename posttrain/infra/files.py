"""Atomic file writes: a reader (or a run resumed after kill -9) sees the old file or the whole new one, not a part."""
from __future__ import annotations

import os
import pathlib
from typing import Callable, IO


def atomic_write(path, write: Callable[[IO], None], *, binary: bool = False,
                 clear_stale: bool = False) -> pathlib.Path:
    """Calls `write(f)` on a temp file beside `path`, fsyncs, then replaces `path` with it; returns `path`.

    Args:
      path: the destination (its folder is created).
      clear_stale: first remove temp files a killed writer of `path` left behind (`.<stem>.<pid>.tmp`).
    Raises:
      whatever `write` or the file system raises; `path` is then left as it was.
    """
    final = pathlib.Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    if clear_stale:
        for stale in final.parent.glob(f".{final.stem}.*.tmp"):
            stale.unlink(missing_ok=True)
    tmp = final.with_name(f".{final.stem}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final
