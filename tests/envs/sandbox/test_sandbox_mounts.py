"""The sandbox shows the running interpreter's environment wherever it lives on the host.

Each case makes a virtual environment (``python -m venv --without-pip``, a few ms) at one host location,
puts a stand-in ``numpy`` package (an allowed package, `mounts.SANDBOX_PACKAGES`) in its site-packages,
and runs a sandboxed program twice in one `Workspace` (its /tmp and /dev/shm persist) from a process
started with that venv's python (so sys.executable, sys.prefix and the site-packages are the venv's):
/tmp and /dev/shm are shadowed inside the sandbox (its own storage), a 0700 parent is one the sandbox
user cannot enter; where the files themselves are unreadable to the sandbox user, `run` raises one line
naming the path.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from envs.sandbox import mounts

ROOT = Path(__file__).resolve().parents[3]
ROOT_MODE = os.geteuid() == 0  # as root the sandbox user is an unprivileged uid; otherwise the caller's uid
PROBE = """
import json, sys
from envs import sandbox
code = "import os, sys, numpy; print(sys.prefix, numpy.WHERE, os.access(os.path.dirname(sys.prefix), os.W_OK))"
try:
    with sandbox.Workspace() as ws:  # twice in one workspace: its /tmp and /dev/shm persist between runs
        rs = [sandbox.run(code, limits=sandbox.Limits(cpu_s=5, wall_s=15), workspace=ws) for _ in range(2)]
    print(json.dumps([{"status": r.status, "stdout": r.stdout, "reason": r.reason, "stderr": r.stderr[-200:]}
                      for r in rs]))
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
"""

def _make_venv(parent: Path) -> Path:
    venv = parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "numpy").mkdir(parents=True)
    (site / "numpy" / "__init__.py").write_text(f"WHERE = {str(parent)!r}\n")
    return venv


def _probe(venv: Path) -> dict:
    """What `sandbox.run` gives in a process whose interpreter is `venv`'s python (imports from the checkout)."""
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p and os.path.isdir(p))])  # envs, gymnasium
    env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_SANDBOX_PYTHON"}
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={**env, "PYTHONPATH": path}, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# (id, host dir the venv's parent is made in, the parent's mode, owner uid of the parent or None,
#  chmod -R go-rwx of the venv, expected: "ok" or "error")
CASES = [
    ("tmp", "/tmp", 0o755, None, False, "ok"),
    ("dev_shm", "/dev/shm", 0o755, None, False, "ok"),
    ("parent_0700", "/tmp", 0o700, None, False, "ok"),  # bound at its own path; the parents are made 0755
    ("venv_private", "/tmp", 0o755, None, True, "error" if ROOT_MODE else "ok"),
    ("parent_foreign_0700", "/tmp", 0o700, 4242, False, "error"),  # bwrap itself cannot enter (root mode)
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreter_is_visible_wherever_it_lives(case):
    name, base, mode, owner, private, expected = case
    if not os.path.isdir(base):
        pytest.skip(reason=f"no {base} here")
    if owner is not None and not ROOT_MODE:
        pytest.skip(reason="chown needs root (and only root mode's bwrap is refused by a foreign 0700 dir)")
    parent = Path(tempfile.mkdtemp(prefix="sbx-interp-", dir=base))
    parent.chmod(0o755)
    try:
        venv = _make_venv(parent)
        if private:
            subprocess.run(["chmod", "-R", "go-rwx", str(venv)], check=True)
        parent.chmod(mode)
        if owner is not None:
            os.chown(parent, owner, owner)
        got = _probe(venv)
    finally:
        parent.chmod(0o755)
        shutil.rmtree(parent)
    if expected == "ok":
        assert [(r["status"], r["stdout"]) for r in got] == [("ok", f"{venv} {parent} False\n")] * 2, got
    else:
        message = got.get("error", "")
        assert "\n" not in message and message.startswith("sandbox: ") and str(parent) in message, got


def test_a_path_inside_the_sandbox_cwd_is_one_clear_error():
    with pytest.raises(RuntimeError, match=f"{mounts.SANDBOX_CWD}/venv.*working directory"):
        mounts.check_visible([f"{mounts.SANDBOX_CWD}/venv/pyvenv.cfg"])


def test_a_venv_reached_through_a_symlink_imports_its_packages():
    # a checkout whose .venv is a symlink to another checkout's: Python's sys.prefix is the link's path, so the
    # site-packages must be shown there too, not only at their real path
    parent = Path(tempfile.mkdtemp(prefix="sbx-interp-", dir="/tmp"))
    parent.chmod(0o755)
    try:
        real = _make_venv(parent)
        link = parent / "linked" / ".venv"
        link.parent.mkdir()
        link.symlink_to(real)
        got = _probe(link)
    finally:
        shutil.rmtree(parent)
    assert [(r["status"], r["stdout"]) for r in got] == [("ok", f"{link} {parent} False\n")] * 2, got
