"""Fixtures of the benchmark tests: one --dry-run of scripts/accelerator_check.sh per session, i.e. per xdist
worker, used only by test_accelerator_check.py (its files and keys, and the quick-mode JSON of the four benches it
runs), so that it runs once per suite under `--dist loadfile`."""
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class DryRun:
    out: pathlib.Path  # the check's output folder
    returncode: int
    stderr: str


@pytest.fixture(scope="session")
def accelerator_dry_run(tmp_path_factory) -> DryRun:
    """Runs `scripts/accelerator_check.sh --dry-run` (this interpreter, no XLA_FLAGS of the caller) into a temporary
    folder; the tests assert on its outcome."""
    tmp = tmp_path_factory.mktemp("accelerator_check")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
    env["PYTHON"] = sys.executable
    r = subprocess.run([str(ROOT / "scripts" / "accelerator_check.sh"), "--dry-run", "--out", str(tmp / "out"),
                        "--cache-dir", str(tmp / "cache")], capture_output=True, text=True, timeout=1500, env=env,
                       cwd=tmp)
    return DryRun(tmp / "out", r.returncode, r.stderr)
