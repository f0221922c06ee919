"""The package import order (docs/design.md "Layout") is a checked contract.

The contracts live in pyproject.toml `[tool.importlinter]` and are checked with import-linter's `lint-imports`
(the dev extra), run here as a subprocess from the venv's bin directory: the `posttrain` phase packages as layers, the
`envs` packages as layers, and `envs` importing neither `posttrain` nor JAX. A second test plants an upward import in
a copy of the packages to show the linter catches it. tests/test_structure.py checks what import-linter does not:
circles inside a package, config sections read outside the loader and entry points, and module aliases.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"
CONTRACT_IDS = [c["id"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]



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
