"""Suite-wide fixtures. Keep this small; shared helpers belong in test modules."""
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_leaks():
    """After the whole session: no sandbox process (bwrap or sandbox uid) and no sandbox temp dir remain."""
    yield
    sandbox = sys.modules.get("envs.sandbox")
    if sandbox is not None:  # never imported: nothing could have leaked through it
        leaks = sandbox.find_leaks()
        assert not leaks, "sandbox leaks at the end of the test session:\n" + "\n".join(leaks)
