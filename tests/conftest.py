"""Suite-wide fixtures. Keep this small; helpers shared by several test modules live in tests/helpers.py."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from helpers import ...` in any test module


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_leaks():
    """After the whole session: no sandbox process (bwrap or sandbox uid) and no sandbox temp dir remain."""
    yield
    sandbox = sys.modules.get("envs.sandbox")
    if sandbox is not None:  # never imported: nothing could have leaked through it
        leaks = sandbox.find_leaks()
        assert not leaks, "sandbox leaks at the end of the test session:\n" + "\n".join(leaks)
