"""How much of the library is prose: docstring and comment-only lines of `posttrain/` and `envs/`.

    python scripts/prose_stats.py [--by-package] [--json] [PATH ...]

Prints the share of docstring lines and of docstring + comment-only lines among all physical lines, the module
docstrings over `MAX_MODULE_DOC_LINES` lines and, with --by-package, the same per package. tests/test_prose.py
holds the library to the caps below.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("posttrain", "envs")
MAX_DOC_SHARE = 0.16
MAX_PROSE_SHARE = 0.17
MAX_MODULE_DOC_LINES = 10


def docstring_nodes(tree: ast.AST) -> list[ast.Expr]:
    """The docstring expressions of a module, its classes and its functions (nested ones included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append(body[0])
    return out


def file_stats(source: str) -> dict:
    """{"lines", "doc", "comment", "module_doc"} of one module's source: physical lines, docstring lines,
    comment-only lines outside docstrings, and the module docstring's lines (0 without one)."""
    tree = ast.parse(source)
    doc_lines: set[int] = set()
    for expr in docstring_nodes(tree):
        doc_lines.update(range(expr.lineno, expr.end_lineno + 1))
    lines = source.splitlines()
    comment_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                     if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#")}
    module = docstring_nodes(ast.Module(body=tree.body, type_ignores=[]))
    module_doc = module[0].end_lineno - module[0].lineno + 1 if module and tree.body and module[0] is tree.body[0] \
        else 0
    return {"lines": len(lines), "doc": len(doc_lines), "comment": len(comment_lines - doc_lines),
            "module_doc": module_doc}


def library_files(paths=LIBRARY) -> list[pathlib.Path]:
    """The .py files under `paths` (folders or files, relative to the checkout root)."""
    out = []
    for root in map(ROOT.joinpath, paths):
        out += [root] if root.is_file() else [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(out)


def stats(files) -> dict:
    """Totals and shares over `files`, the long module docstrings, and per-package totals."""
    total = {"lines": 0, "doc": 0, "comment": 0}
    packages: dict[str, dict] = {}
    long_modules = []
    for path in files:
        s = file_stats(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        package = str(pathlib.PurePosixPath(rel).parent)
        bucket = packages.setdefault(package, {"lines": 0, "doc": 0, "comment": 0})
        for key in total:
            total[key] += s[key]
            bucket[key] += s[key]
        if s["module_doc"] > MAX_MODULE_DOC_LINES:
            long_modules.append((rel, s["module_doc"]))
    share = lambda t: {"doc_share": t["doc"] / max(t["lines"], 1),  # noqa: E731
                       "prose_share": (t["doc"] + t["comment"]) / max(t["lines"], 1)}
    return {**total, **share(total), "long_module_docs": long_modules,
            "packages": {k: {**v, **share(v)} for k, v in sorted(packages.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(LIBRARY))
    parser.add_argument("--by-package", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = stats(library_files(args.paths))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['lines']} lines: docstrings {result['doc']} ({result['doc_share']:.1%}, cap {MAX_DOC_SHARE:.0%}), "
          f"+ comment-only {result['comment']} ({result['prose_share']:.1%}, cap {MAX_PROSE_SHARE:.0%})")
    if args.by_package:
        for name, p in result["packages"].items():
            print(f"  {name:40s} {p['lines']:6d} lines  doc {p['doc_share']:6.1%}  doc+comment {p['prose_share']:6.1%}")
    for rel, n in result["long_module_docs"]:
        print(f"  module docstring over {MAX_MODULE_DOC_LINES} lines: {rel} ({n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
