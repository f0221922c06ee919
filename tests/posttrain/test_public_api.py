"""The README's library API resolves from the top-level package, lazily (importing posttrain imports no JAX)."""
import subprocess
import sys

import posttrain


def test_every_public_name_resolves():
    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None, name
    assert callable(posttrain.load_pretrained) and "grpo" in posttrain.ADVANTAGES and "k3" in posttrain.KL_ESTIMATORS


def test_importing_the_package_is_light():
    code = "import sys, posttrain; assert 'jax' not in sys.modules, 'jax imported'; print(len(posttrain.__all__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(posttrain.__all__)
