"""Suite-wide fixtures. Keep this small; helpers shared by several test modules live in tests/helpers.py."""
import os
import sys

import pytest

# The suite compares against float32 references (NumPy, transformers, sharded vs single device). Pin true float32
# matmuls for this process and its subprocesses: on NVIDIA GPUs JAX's default float32 matmul is TF32 (relative
# error ~3e-4), which fails those comparisons. The product takes its precision from the config's policy
# (`posttrain.infra.precision`); tests/posttrain/test_precision.py checks both mechanisms in the lowered HLO.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from helpers import ...` in any test module


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_leaks():
    """After the whole session: no sandbox process (bwrap or sandbox uid) and no sandbox temp dir remain."""
    yield
    sandbox = sys.modules.get("envs.sandbox")
    if sandbox is not None:  # never imported: nothing could have leaked through it
        leaks = sandbox.find_leaks()
        assert not leaks, "sandbox leaks at the end of the test session:\n" + "\n".join(leaks)
