"""Unified diffs (GNU format) for RepoFix-v0: `make_diff` writes the golden patch; `parse` and `apply` read one.

Reading is lenient where models are sloppy (hunk line counts are not trusted; a hunk goes where its context is
nearest the line its header names) and strict where it matters: every context and removed line must be in the
file, or the whole patch is refused (`PatchError`).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")
NO_NEWLINE = "\\ No newline at end of file"


class PatchError(ValueError):
    """A patch that cannot be read or does not apply (the message says which file and hunk)."""


@dataclasses.dataclass
class Hunk:
    old_start: int  # 1-based line of the hunk's first old line (0 for an empty old side)
    lines: list[str]  # " x", "-x", "+x"


@dataclasses.dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path


def _strip_prefix(header: str) -> str | None:
    path = header[4:].split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    return path[2:] if path.startswith(("a/", "b/")) else path


def parse(text: str) -> list[FilePatch]:
    """The file patches of unified diff `text`. Raises PatchError when it holds none or a hunk has no header."""
    lines = text.splitlines()
    out: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            out.append(FilePatch(_strip_prefix(line), _strip_prefix(lines[i + 1]), []))
            i += 2
            continue
        match = _HUNK_RE.match(line)
        if match:
            if not out:
                raise PatchError(f"hunk {line!r} comes before any '--- a/PATH' / '+++ b/PATH' header")
            hunk = Hunk(int(match.group(1)), [])
            i += 1
            while i < len(lines) and not _HUNK_RE.match(lines[i]) and not (
                    lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
                body = lines[i]
                if body == "":
                    hunk.lines.append(" ")
                elif body[0] in " +-":
                    hunk.lines.append(body)
                elif not body.startswith("\\"):
                    break
                i += 1
            out[-1].hunks.append(hunk)
            continue
        i += 1
    if not out:
        raise PatchError("no file patch found: a unified diff starts with '--- a/PATH' and '+++ b/PATH' lines")
    for fp in out:
        if fp.path is None:
            raise PatchError("a file patch has /dev/null on both sides")
        if not fp.hunks and fp.new_path is not None:
            raise PatchError(f"the patch of {fp.path} has no @@ hunk")
    return out


def _find(lines: list[str], block: list[str], near: int, start: int) -> int | None:
    """Index >= start where `block` occurs in `lines`, nearest to `near` (exact first, then ignoring trailing
    whitespace)."""
    positions = range(start, len(lines) - len(block) + 1)
    for same in (lambda a, b: a == b, lambda a, b: a.rstrip() == b.rstrip()):
        hits = [p for p in positions if all(same(lines[p + k], b) for k, b in enumerate(block))]
        if hits:
            return min(hits, key=lambda p: (abs(p - near), p))
    return None


def _apply_file(fp: FilePatch, old_text: str | None) -> str | None:
    if fp.new_path is None:
        return None
    lines = [] if old_text is None else old_text.splitlines()
    trailing = old_text is None or old_text.endswith("\n") or old_text == ""
    cursor = 0
    for n, hunk in enumerate(fp.hunks, 1):
        old = [h[1:] for h in hunk.lines if h[0] in " -"]
        new = [h[1:] for h in hunk.lines if h[0] in " +"]
        if not old:
            at = min(max(hunk.old_start, 0), len(lines)) if hunk.old_start else 0
        else:
            at = _find(lines, old, hunk.old_start - 1, cursor)
        if at is None:
            raise PatchError(f"hunk {n} of {fp.path} does not match the file: its context and removed lines "
                             f"{old[:3]!r}... are not there (read the file again and rebuild the patch)")
        lines[at:at + len(old)] = new
        cursor = at + len(new)
    return "\n".join(lines) + ("\n" if trailing and lines else "")


def apply(text: str, read: Callable[[str], str | None]) -> dict[str, str | None]:
    """{path: new text, or None to delete} for patch `text`; `read(path)` gives a file's text (None: missing).

    Raises PatchError when the patch cannot be read, a file it changes is missing, a file it creates exists, or a
    hunk does not match (so nothing is written)."""
    out: dict[str, str | None] = {}
    for fp in parse(text):
        source = fp.old_path
        current = out[source] if source in out else (read(source) if source is not None else None)
        if source is not None and current is None:
            raise PatchError(f"{source}: no such file to patch")
        if source is None and (out[fp.new_path] if fp.new_path in out else read(fp.new_path)) is not None:
            raise PatchError(f"{fp.new_path}: the patch creates it, but it exists")
        result = _apply_file(fp, current)
        if source is not None and source != fp.new_path:
            out[source] = None
        out[fp.path] = result
    return out


def make_diff(old: Mapping[str, str], new: Mapping[str, str]) -> str:
    """Unified diff (3 lines of context, a/ b/ prefixes) that turns files `old` into `new` ({path: text})."""
    chunks = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        diff = list(difflib.unified_diff((a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True),
                                         "/dev/null" if a is None else f"a/{path}",
                                         "/dev/null" if b is None else f"b/{path}"))
        chunks.extend(line if line.endswith("\n") else line + "\n" + NO_NEWLINE + "\n" for line in diff)
    return "".join(chunks)
