"""The README's library API resolves from the top-level package, lazily (importing posttrain imports no JAX)."""
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import posttrain

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _documented_names() -> set[str]:
    """The names in the left column of the package docstring's API table."""
    table = posttrain.__doc__.split("re-exported lazily", 1)[1].splitlines()[2:]
    left = [re.split(r"\s{2,}", line.strip())[0] for line in table if line.strip()]
    return {n.strip() for col in left for n in col.split(",") if n.strip()}


def test_the_docstring_table_lists_exactly_the_exports():
    assert _documented_names() == set(posttrain.__all__)
    assert set(dir(posttrain)) >= set(posttrain.__all__)


def test_the_readme_imports_only_exported_names():
    imported = {n.strip() for line in re.findall(r"^from posttrain import (.+)$", README.read_text(), re.M)
                for n in line.split(",")}
    assert imported and imported <= set(posttrain.__all__), imported - set(posttrain.__all__)


@pytest.mark.parametrize("name", posttrain.__all__)
def test_every_public_name_is_a_documented_posttrain_object(name):
    value = getattr(posttrain, name)
    if isinstance(value, dict):  # a registry selected by name: non-empty, name -> function
        assert value and all(isinstance(k, str) and callable(v) for k, v in value.items()), name
        return
    assert callable(value), name
    assert value.__module__.startswith("posttrain."), (name, value.__module__)
    assert inspect.getdoc(value), f"posttrain.{name} has no docstring"


def test_the_registries_hold_the_names_the_readme_lists():
    text = README.read_text()
    for name in ("ADVANTAGES", "POLICY_LOSSES", "KL_ESTIMATORS", "AGGREGATIONS"):
        listed = re.search(rf"`(?:[\w.]+\.)?{name}` \(([^)]*)\)", text)
        assert listed, f"README lists no names for {name}"
        want = {part.split()[0] for part in listed.group(1).split(",")}
        assert set(getattr(posttrain, name)) == want, name


def test_an_unknown_name_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        posttrain.nonexistent  # noqa: B018


def test_importing_the_package_is_light_and_registers_the_envs():
    code = ("import sys, posttrain, gymnasium; assert 'jax' not in sys.modules, 'jax imported'; "
            "assert {'posttrain/Arithmetic-v0', 'posttrain/GSM8K-v0'} <= set(gymnasium.registry); "
            "gymnasium.make('posttrain/Arithmetic-v0').reset(seed=0); print(len(posttrain.__all__))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(posttrain.__all__)


def test_the_command_line_loads_jax_only_for_a_command_that_needs_it(tmp_path):
    """cli/commands.py imports each recipe inside its command: the usage line, `posttrain status --help`, `status`
    of a run (its status.json and metrics.jsonl) and of a missing run stay JAX-free (a new top-level recipe import,
    or a cluster start for them, fails this)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (run / "status.json").write_text('{"step": 1, "domains": {}}')
    code = (f"import sys; from posttrain import cli; cli.main(['posttrain']); cli.main(['posttrain', 'status', '--help']); "
            f"cli.main(['posttrain', 'status', '--workdir={run}']); cli.main(['posttrain', 'status', "
            f"'--workdir={tmp_path}/none']); assert 'jax' not in sys.modules, 'jax imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
