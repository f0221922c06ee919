"""The library's prose stays short and current (CONVENTIONS.md, "Docstrings").

Docstring and comment-only lines under the caps of scripts/prose_stats.py; module docstrings of at most ten lines;
a one-line summary opening every public docstring; no issue numbers, dates or commit ids (history lives in the
commits and the README's tables); no path to a module or file that does not exist.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prose_stats", ROOT / "scripts" / "prose_stats.py")
prose = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prose)

HISTORY = [  # what a measurement's or a change's history looks like in prose
    (re.compile(r"\b[Ii]ssues? #?\d+"), "an issue number"),
    (re.compile(r"(?<![\w/.-])#\d{2,}\b"), "an issue number"),
    (re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b"), "a date"),
    (re.compile(r"\b(?:commit|at) [0-9a-f]{7,40}\b"), "a commit id"),
]
DOTTED = re.compile(r"(?<![\w.])((?:posttrain|envs)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
FILE_PATH = re.compile(r"(?<![\w./-])((?:posttrain|envs|configs|docs|scripts|bench|launch|colab|tests/posttrain|tests/envs)"
                       r"/[\w./*<>-]*[\w*>])")
NOT_A_PATH = re.compile(r"-v\d+$|(^|/)[A-Z]+(\.py)?$")  # env ids (posttrain/Arithmetic-v0), placeholders (configs/X.py)
OLD_PATHS = {"posttrain/_moved.py"}  # the table of moved modules names the old paths on purpose


def prose_of(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a module."""
    tree = ast.parse(source)
    out = [(e.lineno, e.value.value) for e in prose.docstring_nodes(tree)]
    import io
    import tokenize
    out += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT]
    return out


def history_in(source: str, rel: str) -> list[str]:
    return [f"{rel}:{line}: {what}: {m.group(0)!r}" for line, text in prose_of(source)
            for pattern, what in HISTORY for m in pattern.finditer(text)]


def _exists_dotted(name: str) -> bool:
    """True when `name` is a module of this checkout or an attribute path inside one: its longest prefix that is a
    module is a file (the rest are its attributes), or a package whose next part is a name its __init__.py
    defines (a missing submodule is not)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:n])
        if path.with_suffix(".py").is_file():
            return True
        if (path / "__init__.py").is_file():
            return n == len(parts) or re.search(rf"\b{parts[n]}\b", (path / "__init__.py").read_text()) is not None
    return False


def stale_paths_in(source: str, rel: str) -> list[str]:
    if rel in OLD_PATHS:
        return []
    out = []
    for line, text in prose_of(source):
        for m in DOTTED.finditer(text):
            if not _exists_dotted(m.group(1).rstrip(".")):
                out.append(f"{rel}:{line}: {m.group(1)} names no module")
        for m in FILE_PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if not set("*<>") & set(path) and not NOT_A_PATH.search(path) and not (ROOT / path).exists():
                out.append(f"{rel}:{line}: {path} does not exist")
    return out


def summary_problems(source: str, rel: str) -> list[str]:
    """Public functions and methods whose docstring does not open with a one-line summary ending in a period."""
    out = []
    tree = ast.parse(source)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes += [m for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_") for m in c.body
              if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        if node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None:
            continue
        lines = doc.strip("\n").splitlines()
        first = lines[0].strip() if lines else ""
        if not first.endswith((".", ":")) or (len(lines) > 1 and lines[1].strip()):
            out.append(f"{rel}:{node.lineno}: {node.name}: no one-line summary ({first[:60]!r}...)")
    return out


LIBRARY = [p for p in prose.library_files()]


def _rel(path):
    return path.relative_to(ROOT).as_posix()


def test_prose_shares_are_under_their_caps():
    s = prose.stats(LIBRARY)
    assert s["lines"] > 10000, s["lines"]
    assert s["doc_share"] <= prose.MAX_DOC_SHARE, f"docstrings are {s['doc_share']:.1%} of library lines"
    assert s["prose_share"] <= prose.MAX_PROSE_SHARE, f"docstrings + comments are {s['prose_share']:.1%}"


def test_module_docstrings_are_at_most_ten_lines():
    assert not prose.stats(LIBRARY)["long_module_docs"]


@pytest.mark.parametrize("check", [history_in, stale_paths_in, summary_problems])
def test_library_prose(check):
    found = [problem for p in LIBRARY for problem in check(p.read_text(), _rel(p))]
    assert not found, "\n".join(found[:40]) + (f"\n... {len(found) - 40} more" if len(found) > 40 else "")


def legends_in(source: str, rel: str) -> list[str]:
    """A dimension legend anywhere but posttrain/types.py (the one legend; modules point to it)."""
    if rel == "posttrain/types.py":
        return []
    return [f"{rel}:{line}: a dimension legend of its own" for line, text in prose_of(source)
            if "dimension legend" in text.lower()]


def test_one_shape_legend():
    assert "# SHAPE LEGEND" in (ROOT / "posttrain/types.py").read_text()
    found = [problem for p in LIBRARY for problem in legends_in(p.read_text(), _rel(p))]
    assert not found, "\n".join(found)
    assert legends_in('"""Mod.\n\nDimension legend:\n  B batch\n"""\n', "posttrain/x.py")


def test_planted_cases_are_caught():
    planted = '''"""Mod.

Measured on 2026-12-04 (issue 24 item 3, see #123) at 02e6560; `posttrain.tasks.archive` and posttrain/nowhere.py.
"""


def f():
    """Does f
    over two lines."""
'''
    assert len(history_in(planted, "m.py")) == 4
    stale = stale_paths_in(planted, "m.py")
    assert any("posttrain.tasks.archive" in s for s in stale) and any("posttrain/nowhere.py" in s for s in stale)
    assert summary_problems(planted, "m.py") and not summary_problems('def f():\n    """Does f."""\n', "m.py")
    assert not stale_paths_in('"""`posttrain.scheduling.archive.read`, posttrain/types.py."""\n', "m.py")
    long_doc = '"""' + "\n".join(["x"] * 11) + '"""\n'
    assert prose.file_stats(long_doc)["module_doc"] == 11
