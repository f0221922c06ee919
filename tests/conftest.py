"""Suite-wide fixtures. Keep this small; helpers shared by several test modules live in tests/helpers.py."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The suite compares against float32 references (NumPy, transformers, sharded vs single device). Pin true float32
# matmuls for this process and its subprocesses: on NVIDIA GPUs JAX's default float32 matmul is TF32 (relative
# error ~3e-4), which fails those comparisons. The product takes its precision from the config's policy
# (`posttrain.infra.precision`); tests/posttrain/test_precision.py checks both mechanisms in the lowered HLO.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Tests compile far more than they compute: LLVM's optimisation of XLA:CPU's generated code is most of a tiny
# program's compile time and buys the suite nothing (dots run in library kernels either way: SmolLM2's parity tests
# take the same time). The suite and the processes it starts compile at -O0, and with XLA:CPU's loop emitters
# instead of its MLIR fusion emitters (`xla_cpu_use_fusion_emitters=false`), whose compile is most of what is left
# of a small program's (the engine's many decode programs above all). The bit-exact recordings in tests/golden/ hold
# at these settings. POSTTRAIN_TEST_FAST_COMPILE=0 compiles as the product does. XLA aborts a process whose
# XLA_FLAGS names a flag it does not know, so the emitter flag is added only if a child process starts with it
# (once per session: xdist workers and the suite's processes inherit the variable).
if os.environ.get("POSTTRAIN_TEST_FAST_COMPILE", "1") != "0" and "optimization_level" not in os.environ.get(
        "XLA_FLAGS", ""):
    _flags = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    _probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                            env=dict(os.environ, XLA_FLAGS=_flags + " --xla_cpu_use_fusion_emitters=false",
                                     JAX_PLATFORMS="cpu"), capture_output=True, timeout=120)
    os.environ["XLA_FLAGS"] = _flags + (" --xla_cpu_use_fusion_emitters=false" if _probe.returncode == 0 else "")
# Nothing in the suite reads the Hugging Face Hub (models come from packages or are made in the test): offline, a
# transformers/TRL call that would ask the Hub fails at once instead of waiting on a network that does not answer.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])

# One persistent XLA compilation cache for the whole session and every process it starts (`posttrain.cli` reads
# POSTTRAIN_XLA_CACHE, other processes JAX's own variables): many tests compile the same tiny-model programs
# (sampler, train step, init), and a cache hit loads the executable instead of compiling it again. Fresh per session
# (removed at exit), so no test depends on an earlier run. A compile with a buffer dump
# (`infra.aot.compile_with_report`) never hits it: its options name a new dump folder each time.
# POSTTRAIN_TEST_XLA_CACHE=0 turns it off. Under pytest-xdist the workers inherit the controlling process's folder
# (POSTTRAIN_TEST_XLA_CACHE_DIR), so a program compiled by one worker is loaded by the other; the process that
# made the folder removes it.
if os.environ.get("POSTTRAIN_TEST_XLA_CACHE", "1") != "0":
    _XLA_CACHE = os.environ.get("POSTTRAIN_TEST_XLA_CACHE_DIR", "")
    if not (os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(_XLA_CACHE)):
        _XLA_CACHE = tempfile.mkdtemp(prefix="posttrain-test-xla-")
        atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
        os.environ["POSTTRAIN_TEST_XLA_CACHE_DIR"] = _XLA_CACHE
    os.environ["POSTTRAIN_XLA_CACHE"] = _XLA_CACHE
    # JAX reads these at start-up (its flags' environment names): every other process the suite starts (notebook
    # kernels, bench subprocesses, scripts, multi-process tests) shares the cache too
    _MIN_COMPILE_S = "0.2"  # compiles shorter than this are not written
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = _MIN_COMPILE_S
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)  # this process imported JAX before setting them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(_MIN_COMPILE_S))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from helpers import ...` in any test module


@pytest.fixture(autouse=True)
def restore_environment():
    """Every test leaves os.environ as it found it: a variable set in this process (e.g. XLA_FLAGS asking for 8
    fake devices) would otherwise reach every subprocess a later test starts."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_leaks():
    """After the whole session: no sandbox process (bwrap or sandbox uid) and no sandbox temp dir remain."""
    yield
    sandbox = sys.modules.get("envs.sandbox")
    if sandbox is not None:  # never imported: nothing could have leaked through it
        leaks = sandbox.find_leaks()
        assert not leaks, "sandbox leaks at the end of the test session:\n" + "\n".join(leaks)


def _memory_maps() -> tuple[int, int]:
    """(this process's memory mappings, the kernel's limit vm.max_map_count); (0, 0) where /proc does not tell."""
    try:
        with open("/proc/self/maps", encoding="ascii") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return 0, 0


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """After a test module: drop JAX's compiled programs once this process holds more than half the kernel's memory
    mappings. Every XLA:CPU executable keeps its generated code in memory mappings of its own (about 12 for a small
    program, hundreds for a sampler) for as long as a cache holds it; a pytest-xdist worker that runs a thousand tests
    passed the default limit of 65530 mappings, and XLA's next compile died of a segmentation fault (the worker went
    down at 93-99% of the suite and the session never finished). Clearing only past half the limit keeps the cache
    hits between modules that stay below it."""
    yield
    used, limit = _memory_maps()
    if limit and used > limit // 2:
        import gc

        jax.clear_caches()
        gc.collect()


# Test tiers (tests/BUDGET.md). "fast" (`scripts/test.sh fast`): units and references. The CI tier (plain
# `scripts/test.sh`) adds the modules below: training loops, subprocesses, notebooks and bench quick modes. "full"
# (`scripts/test.sh full`) adds the cases marked `slow`: heavy matrices kept out of CI.
CI_TIER = (
    "tests/bench/", "tests/test_notebooks.py", "tests/test_readme.py", "tests/test_compare_commits.py",
    "tests/posttrain/test_cli", "tests/posttrain/recipes/", "tests/posttrain/infra/test_distributed.py",
    "tests/posttrain/infra/test_stop_signals.py", "tests/posttrain/infra/test_reshard.py",
    "tests/posttrain/rollout/test_ray_runner.py", "tests/posttrain/rollout/test_attempts.py",
    "tests/posttrain/rollout/test_attempts_kill.py", "tests/posttrain/rollout/test_queue.py",
    "tests/posttrain/rollout/test_partial_rollouts.py", "tests/posttrain/learn/test_offline_loop.py",
    "tests/posttrain/model/test_smollm2_parity.py", "tests/posttrain/model/test_expert_parallel.py",
    "tests/posttrain/model/test_sharded_moe.py", "tests/posttrain/algos/grpo/test_grpo_step_bf16_sharded.py",
    "tests/posttrain/generate/test_backend.py", "tests/posttrain/generate/test_engine_routing.py",
    "tests/posttrain/generate/test_sampler.py", "tests/posttrain/generate/test_engine.py",
    "tests/posttrain/generate/test_engine_reuse.py", "tests/posttrain/generate/test_engine_fixture.py",
    "tests/posttrain/rollout/test_chat.py",
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = os.path.relpath(str(item.fspath), _ROOT).replace(os.sep, "/")
        if rel.startswith(CI_TIER):
            item.add_marker(pytest.mark.ci)
