"""Module paths from before the generate/, scheduling/ and runs/ packages still import, with a DeprecationWarning,
as the very module now at the new path; nothing in this checkout uses an old path."""
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

from posttrain import _moved

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_path_is_the_new_module(old, new):
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_imports_of_old_packages_work_in_a_fresh_process():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import posttrain\n"
            "try:\n    from posttrain.tasks import archive\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
            "warnings.simplefilter('ignore')\n"
            "from posttrain.tasks import archive\nfrom posttrain.rollout.sampler import sample\n"
            "import posttrain.scheduling.archive as new\nprint(archive is new, sample.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "warned: posttrain.tasks.archive moved to posttrain.scheduling.archive" in out.stdout
    assert "True posttrain.generate.sampler" in out.stdout


def test_nothing_in_the_checkout_uses_an_old_path():
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in _moved.MOVED) + r")(?![\w])")
    skip = {ROOT / "posttrain/_moved.py", ROOT / "tests/test_prose.py", pathlib.Path(__file__).resolve()}  # planted cases
    found = []
    for folder in ("posttrain", "envs", "tests", "bench", "scripts", "configs", "colab", "docs", "launch"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".ipynb", ".sh") and path not in skip:
                found += [f"{path.relative_to(ROOT)}: {m.group(1)}" for m in pattern.finditer(path.read_text())]
    found += [f"README.md: {m.group(1)}" for m in pattern.finditer((ROOT / "README.md").read_text())]
    assert not found, "\n".join(found)
