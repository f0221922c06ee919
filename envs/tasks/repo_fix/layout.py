"""The repository of a RepoFix-v0 task: a small package, its README, a command line and visible tests.

    README.md                  what each function does (its docstring), how to run the tests
    toolbox/__init__.py        re-exports every function; toolbox/__main__.py: python -m toolbox FUNCTION [ARG ...]
    toolbox/core.py            the first problem's module (``extras.py`` for a second problem)
    tests/run_tests.py         runs every test_* of tests/test_*.py (standard library, no pytest); exit 1 on a failure
    tests/test_core.py         the visible cases, as plain asserts

Hidden tests are never laid out here: they stay in the task dict, on the host (`envs.tasks.repo_fix.scoring`).
"""
from __future__ import annotations

import ast
import dataclasses
import textwrap

from envs.tasks.repo_fix import problems as problems_lib

PACKAGE = "toolbox"
MODULES = ("core", "extras")  # module names of a task's first and second problem
RUNNER_PATH = "tests/run_tests.py"
RUNNER = '''"""Run the tests: python tests/run_tests.py [-v] [NAME ...] (standard library only, no pytest).

Calls every function named test_* in tests/test_*.py (only those whose name contains one of the NAMEs, when given);
an exception, a failed assert included, fails the test. Exit status 0 when every test passed, 1 otherwise.
"""
import importlib.util
import pathlib
import signal
import sys
import traceback

TESTS = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 10  # per test


def _timeout(signum, frame):
    raise TimeoutError(f"test took longer than {TIMEOUT_S} s")


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name, test, verbose):
    signal.alarm(TIMEOUT_S)
    try:
        test()
    except Exception:
        print(f"FAIL {name}")
        traceback.print_exc(file=sys.stdout)
        return False
    finally:
        signal.alarm(0)
    if verbose:
        print(f"ok   {name}")
    return True


def main(argv):
    sys.path.insert(0, str(TESTS.parent))
    signal.signal(signal.SIGALRM, _timeout)
    verbose, names = "-v" in argv, [a for a in argv if not a.startswith("-")]
    passed = failed = 0
    for path in sorted(TESTS.glob("test_*.py")):
        try:
            module = _load(path)
        except Exception:
            print(f"ERROR {path.name}: the test file could not be imported")
            traceback.print_exc(file=sys.stdout)
            failed += 1
            continue
        for name, test in vars(module).items():
            if name.startswith("test_") and callable(test) and (not names or any(n in name for n in names)):
                if _run(f"{path.name}::{name}", test, verbose):
                    passed += 1
                else:
                    failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''
MAIN = f'''"""Command line: python -m {PACKAGE} FUNCTION [JSON_ARG ...] prints repr(FUNCTION(*args))."""
import json
import sys

import {PACKAGE}


def main(argv):
    if not argv or argv[0] not in {PACKAGE}.__all__:
        print("usage: python -m {PACKAGE} FUNCTION [JSON_ARG ...]; functions: " + ", ".join({PACKAGE}.__all__))
        return 2
    print(repr(getattr({PACKAGE}, argv[0])(*[json.loads(a) for a in argv[1:]])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


@dataclasses.dataclass(frozen=True)
class Part:
    """One problem of a task: its module name (`MODULES`), module text (mutated or not) and visible cases."""

    problem: problems_lib.Problem
    module: str
    text: str
    visible: tuple[problems_lib.Case, ...]

    @property
    def path(self) -> str:
        return f"{PACKAGE}/{self.module}.py"


def _docstring(problem: problems_lib.Problem) -> str:
    for node in ast.parse(problem.module).body:
        if isinstance(node, ast.FunctionDef) and node.name == problem.entry:
            return ast.get_docstring(node) or ""
    return ""


def readme(parts: list[Part]) -> str:
    """README.md: one section per function (signature and docstring), the command line and the tests."""
    lines = [f"# {PACKAGE}", "", "Small, documented utility functions.", "", "## Functions", ""]
    for part in parts:
        lines += [f"### `{PACKAGE}.{part.problem.entry}` (in `{part.path}`)", "",
                  textwrap.indent(_docstring(part.problem), "    "), ""]
    lines += ["## Command line", "", f"    python -m {PACKAGE} FUNCTION [JSON_ARG ...]", "", "## Tests", "",
              "    python tests/run_tests.py        # every test; -v lists the passing ones too",
              "    python tests/run_tests.py NAME   # only the tests whose name contains NAME", ""]
    return "\n".join(lines)


def init_module(parts: list[Part]) -> str:
    imports = [f"from {PACKAGE}.{p.module} import {p.problem.entry}" for p in parts]
    names = ", ".join(f'"{p.problem.entry}"' for p in parts)
    return "\n".join([f'"""{PACKAGE}: small, documented utility functions (see README.md)."""', *imports, "",
                      f"__all__ = [{names}]", ""])


def files(parts: list[Part]) -> dict[str, str]:
    """Every file of the repository, {relative path: text}."""
    out = {"README.md": readme(parts), f"{PACKAGE}/__init__.py": init_module(parts), f"{PACKAGE}/__main__.py": MAIN,
           RUNNER_PATH: RUNNER}
    for part in parts:
        out[part.path] = part.text
        out[f"tests/test_{part.module}.py"] = problems_lib.visible_test_file(part.problem, part.visible, PACKAGE,
                                                                              part.module)
    return out


def suite(part: Part, cases: tuple[problems_lib.Case, ...]) -> dict:
    """What the trusted runner needs to run `cases` of one part: module, entry, prelude and case sources."""
    return {"module": f"{PACKAGE}.{part.module}", "entry": part.problem.entry, "prelude": part.problem.prelude,
            "cases": [c.source for c in cases]}
