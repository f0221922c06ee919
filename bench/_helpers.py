"""Helpers of the benchmarks in bench/ (not a benchmark): the --quick command-line preamble every bench shares, a
preset's random weights written as an HF directory (for comparisons with transformers / TRL on the same weights),
and the compile-first timing of variants that runs only those whose compiled peak memory fits the backend
(bench/moe.py, bench/attention.py).
"""
from __future__ import annotations

import argparse
import sys
import time

INIT_STD = 0.02  # standard deviation of every weight matrix and the embedding (norm scales are ones)
_START = time.perf_counter()


def progress(message: str) -> None:
    """One line on stderr, "[bench +S s] message" (S: seconds since this module was imported), so that a run cut
    short by a timeout (scripts/accelerator_check.py keeps the step's stderr tail) says which phase it was in."""
    print(f"[bench +{time.perf_counter() - _START:.1f} s] {message}", file=sys.stderr, flush=True)


def parse_quick(ap: argparse.ArgumentParser, argv, quick: dict, help: str = "") -> argparse.Namespace:
    """Adds --quick to `ap` and parses `argv` (None: sys.argv[1:]); when --quick is among them, the entries of
    `quick` are the defaults, so values given on the command line still win. `help` defaults to
    "seconds: <quick> unless given". Raises SystemExit (argparse's status 2) on bad arguments."""
    ap.add_argument("--quick", action="store_true", help=help or f"seconds: {quick} unless given")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:
        ap.set_defaults(**quick)
    return ap.parse_args(argv)


def write_preset_model(name: str, out_dir: str, overrides: dict | None = None, seed: int = 0):
    """Writes preset `name` (float32, `overrides` applied; a vocabulary smaller than the byte tokenizer's gets 320
    ids) with random weights and the byte tokenizer to `out_dir` (`posttrain.checkpoints.export.export_hf`);
    returns its ModelConfig. Weights: NumPy normal(0, INIT_STD) of `seed`, norm scales ones, filled into the shapes
    of `nnx.eval_shape` (instant, where the model's own jax.random init costs seconds of XLA compiles on a CPU).
    Raises KeyError for an unknown preset."""
    import jax
    import numpy as np
    from flax import nnx

    from posttrain.checkpoints.export import export_hf
    from posttrain.model.presets import get_preset
    from posttrain.model.tokenizer import Tokenizer
    from posttrain.model.transformer import Transformer

    tokenizer = Tokenizer.byte_level()
    fields = dict(dtype="float32", param_dtype="float32", **(overrides or {}))
    cfg = get_preset(name, **fields)
    if cfg.vocab_size < tokenizer.vocab_size:
        cfg = get_preset(name, **{**fields, "vocab_size": 320})
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(leaf.shape, np.float32)
        return (INIT_STD * rng.standard_normal(leaf.shape, np.float32)).astype(np.float32)

    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    export_hf(cfg, jax.tree_util.tree_map_with_path(fill, abstract), out_dir, tokenizer=tokenizer)
    return cfg


def gib(num_bytes: int) -> float:
    """`num_bytes` in GiB, 4 significant digits."""
    return float(f"{num_bytes / 2 ** 30:.4g}")


def free_bytes(device) -> int:
    """Memory a variant may use on `device`: its allocator's limit minus what is in use, on a CPU the host's
    MemAvailable (/proc/meminfo)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def measure(fn, xs, steps: int) -> float:
    """Best of `steps` timed calls of `fn(*xs)` (seconds) after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*xs))
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        best = min(best, time.perf_counter() - t)
    return best


def compile_variants(make_fn, names, specs, budget: int, peer: str, aot: bool = False) -> tuple[dict, dict]:
    """Compiles `make_fn(name)` (a jitted function) for `specs` (ShapeDtypeStructs) for `peer` and each of `names`;
    returns (results, compiled). results[name]: compile seconds and peak GiB (`posttrain.infra.aot.compile_with_report`:
    arguments + outputs + temporaries), with `aot` also temp GiB and the largest buffers. Without `aot`, compiled
    holds the executables whose peak fits `budget` bytes (`aot.fits`); the others' results say "skipped" and why
    (all are skipped when the peer does not fit). A compile that runs out of device memory (XLA's GPU autotuner
    runs candidate kernels on buffers of the real size: at the default MoE shape "ragged" asked an H200 for
    128 GiB) is reported "skipped" with XLA's first line, and the other variants still run."""
    import jax

    from posttrain.infra import aot as aot_lib

    results, compiled = {}, {}
    for name in [peer] + [n for n in names if n != peer]:
        t = time.perf_counter()
        try:
            fn, report, seconds = aot_lib.compile_with_report(make_fn(name).lower(*specs), top=3)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            results[name] = {"compile_s": round(time.perf_counter() - t, 1), "peak_gib": None,
                             "skipped": "compile ran out of device memory: " + str(e).strip().splitlines()[0][:300]}
            continue
        r = results[name] = {"compile_s": round(seconds, 1), "peak_gib": gib(report.peak)}
        if aot:
            r.update(temp_gib=round(report.temp / aot_lib.GIB, 3), largest_buffers=report.as_dict()["largest_buffers"])
        elif name != peer and peer not in compiled:
            r["skipped"] = f"the {peer} peer does not fit"
        elif aot_lib.fits(report.peak, budget):
            compiled[name] = fn
        else:
            r["skipped"] = f"needs {r['peak_gib']} GiB, more than fits in {gib(budget)} GiB"
    return results, compiled


def time_variants(results: dict, compiled: dict, xs, steps: int, peer: str, tokens: int, flops: float) -> None:
    """Times each compiled variant on inputs `xs` (`measure`) and adds step_s, tokens_per_s, tflops and
    ratio_to_<peer> (the peer's seconds / the variant's: above 1 is faster) to its `results` entry."""
    peer_s = measure(compiled[peer], xs, steps) if peer in compiled else None
    for name, fn in compiled.items():
        s = peer_s if name == peer else measure(fn, xs, steps)
        results[name].update(step_s=round(s, 4), tokens_per_s=round(tokens / s, 1), tflops=round(flops / s / 1e12, 3),
                             **{f"ratio_to_{peer}": round(peer_s / s, 3)})
