"""`aot.compile_with_report` compiles for real under JAX's persistent compilation cache (which the suite turns on,
tests/conftest.py): a cached executable would be loaded with no buffer-assignment dump. The cache keeps working
for other programs afterwards."""
import os

import jax
import jax.numpy as jnp

from posttrain.infra import aot


def test_buffer_report_under_a_warm_persistent_cache(tmp_path):
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # this small program compiles fast
    try:
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()  # make JAX read the new folder
        f = jax.jit(lambda x: jnp.sin(x) @ x.T)
        f.lower(jnp.ones((128, 128))).compile()  # now in the cache
        assert os.listdir(tmp_path)
        _, report, _ = aot.compile_with_report(f.lower(jnp.ones((128, 128))))
        assert report.largest and report.peak > 0
        n = len(os.listdir(tmp_path))
        jax.jit(lambda x: jnp.cos(x) + 1.0)(jnp.ones((64, 64)))  # a new program still lands in the cache
        assert len(os.listdir(tmp_path)) > n
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()
