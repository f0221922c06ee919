"""The package import order (docs/design.md "Layout") is a checked contract.

The contracts live in pyproject.toml `[tool.importlinter]` and are checked with import-linter's `lint-imports`
(the dev extra), run here as a subprocess from the venv's bin directory: the `posttrain` phase packages as layers, the
`envs` packages as layers, and `envs` importing neither `posttrain` nor JAX. A second test plants an upward import in
a copy of the packages to show the linter catches it. An AST test enforces "RunPlan is the only reader of Config":
outside posttrain/config/, posttrain/recipes/ and posttrain/cli/ no module imports `Config` or takes a parameter
annotated `Config`, and RunPlan carries no `Config` field.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"
CONTRACT_IDS = [c["id"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]

# Config may be read only here (paths relative to the checkout root).
CONFIG_READERS = ("posttrain/config/", "posttrain/recipes/", "posttrain/runs/", "posttrain/cli/")
CONFIG_MODULES = {"posttrain", "posttrain.config", "posttrain.config.schema"}  # modules that export `Config`
CONFIG_NAME = re.compile(r"\bConfig\b")  # the identifier Config, not ModelConfig / RLConfig


def _lint(cwd: pathlib.Path, *contracts: str) -> subprocess.CompletedProcess:
    """Runs lint-imports in `cwd` (its pyproject.toml), with `cwd` first on PYTHONPATH so its packages are the ones read."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: install the dev extra (scripts/setup_env.sh dev)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])]))
    argv = [str(LINT_IMPORTS), "--no-cache", "--no-logo", *(arg for c in contracts for arg in ("--contract", c))]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("contract", CONTRACT_IDS)
def test_contracts_hold(contract):
    result = _lint(ROOT, contract)
    assert result.returncode == 0, f"contract {contract!r} broken:\n{result.stdout}\n{result.stderr}"
    assert "KEPT" in result.stdout, result.stdout


@pytest.mark.parametrize("contract, module, source, imported", [
    pytest.param("posttrain-layers", "posttrain.model._violation", "import posttrain.recipes.grpo  # noqa: F401\n",
                 "posttrain.recipes.grpo", id="model-imports-recipes"),
    pytest.param("envs-layers", "envs.verify._violation", "from envs.tasks import arithmetic  # noqa: F401\n",
                 "envs.tasks.arithmetic", id="verify-imports-tasks"),
    pytest.param("envs-no-jax", "envs.tasks._violation", "import jax  # noqa: F401\n", "jax", id="envs-imports-jax"),
    pytest.param("envs-no-jax", "envs.sandbox._violation", "from posttrain import types  # noqa: F401\n",
                 "posttrain.types", id="envs-imports-posttrain"),
])
def test_contract_catches_an_upward_import(tmp_path, contract, module, source, imported):
    for package in ("posttrain", "envs"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / (module.replace(".", "/") + ".py")).write_text(source)
    result = _lint(tmp_path, contract)
    report = result.stdout + result.stderr
    assert result.returncode != 0, f"{module} importing {imported} passed contract {contract!r}:\n{report}"
    assert f"{module} -> {imported}" in report, report


def _is_config_reader(path: pathlib.Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(rel == r or rel.startswith(r) for r in CONFIG_READERS)


def _absolute(node: ast.ImportFrom, path: pathlib.Path) -> str:
    """The absolute module of a `from ... import`, resolving relative imports against the file's package."""
    if not node.level:
        return node.module or ""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # a module's package; for __init__.py the package itself
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _config_uses(path: pathlib.Path) -> list[str]:
    """Every import of Config and every parameter annotated Config in one module, as 'path:line: what'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    found, module_aliases = [], set(CONFIG_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in CONFIG_MODULES and alias.asname:
                    module_aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            for alias in node.names:
                if module in CONFIG_MODULES and alias.name in ("Config", "*"):
                    found.append(f"{rel}:{node.lineno}: from {module} import {alias.name}")
                if f"{module}.{alias.name}" in CONFIG_MODULES:
                    module_aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "Config" and ast.unparse(node.value) in module_aliases:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]:
                if arg.annotation is not None and CONFIG_NAME.search(ast.unparse(arg.annotation)):
                    found.append(f"{rel}:{arg.lineno}: {node.name}({arg.arg}: {ast.unparse(arg.annotation)})")
    return list(dict.fromkeys(found))


def test_config_read_only_by_recipes():
    files = sorted(p for p in (ROOT / "posttrain").rglob("*.py") if not _is_config_reader(p))
    assert len(files) > 20, f"expected the posttrain modules under {ROOT / 'posttrain'}, found {len(files)}"
    problems = [use for p in files for use in _config_uses(p)]

    run_plan = ROOT / "posttrain/runs/plan.py"
    classes = [n for n in ast.parse(run_plan.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "RunPlan"]
    assert len(classes) == 1, f"expected one class RunPlan in {run_plan}, found {len(classes)}"
    fields = {n.target.id: n for n in classes[0].body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert fields, f"RunPlan in {run_plan} declares no fields"
    problems += [f"posttrain/runs/plan.py:{n.lineno}: RunPlan.{name}: {ast.unparse(n.annotation)}"
                 for name, n in fields.items() if CONFIG_NAME.search(ast.unparse(n.annotation))]
    if "config_dict" in fields:
        annotation = fields["config_dict"].annotation
        head = annotation.value if isinstance(annotation, ast.Subscript) else annotation
        if ast.unparse(head) != "dict":
            problems.append(f"RunPlan.config_dict must be a dict, is {ast.unparse(annotation)}")
    assert not problems, ("Config read outside config/, recipes/ and cli/, or carried by RunPlan (docs/design.md: "
                          "RunPlan is the only reader of Config and holds only derived settings):\n" + "\n".join(problems))
