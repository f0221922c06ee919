"""`bench/rollout.py --aot TARGET`: the rollout engine's decode step compiled ahead of time; its per-device memory.

    python bench/rollout.py --aot h200 --json     # needs jax-cuda12-plugin + pjrt of jaxlib's version (the aot extra)
    python bench/rollout.py --aot v5p --json      # needs libtpu (the tpu extra)
    python bench/rollout.py --aot cpu --quick     # this machine's CPU (the same path; tests/bench)
The compilers need no accelerator: --aot h200 re-executes under .venv-aot (`VENV=.venv-aot scripts/setup_env.sh
aot`) when this interpreter lacks the CUDA plugin; plugin wheels installed with `pip install --target DIR` and put
on PYTHONPATH work too (how the figures below were made).

Issue 25 item 7 / acceptance 4. Nothing runs and no weights are allocated: `engine_ops.decode_chunk` (K decode
steps, K the engine's default for the target's platform: 8 on GPU / TPU, 1 on the CPU; each step one token for
each of S slots: attention over the page pool, the pool written and donated, the next token picked) is lowered
for one device of TARGET (`posttrain.infra.aot.target_devices`; one-device mesh, the training rules) with
abstract model weights and an abstract page pool, compiled with XLA's buffer-assignment dump, and
`compiled.memory_analysis()` read: argument, output, alias, temp and generated-code bytes, the buffer
assignment's temp allocation and the peak (`aot.MemoryReport.peak`: arguments + outputs - aliases + temp; the
pool is donated, so it counts once).

Shapes, default: configs/quickstart.py's rollout: smollm2-135m, S = 64 slots (8 prompts x 8 samples), sequences
of --max-seq-len 80 tokens (its ~46-token prompts padded to 64 + 24 new tokens, rounded to pages of 16), a pool
holding every slot at full length (S * ceil(80 / 16) + 1 pages). The precision policy of the target's platform
(`infra.precision.resolve_policy("auto", "auto")`: bfloat16 compute and page pool on GPU / TPU, float32
weights as the training state holds them; float32 everywhere on the CPU). Attention over pages: the engine's
kernel for that platform (`paged_attention.resolve_impl("auto", platform)`); when its lowering or compile fails
(e.g. Triton without CUDA tools), the gather reference is compiled instead and the error is in the JSON.
Prints ONE JSON object: the target, shapes, pool bytes (`kv_pages.pool_bytes`), weights bytes, the memory
figures in GiB, the largest buffers, the compile seconds, the attention implementation compiled; a program XLA
refuses as larger than the device (RESOURCE_EXHAUSTED) gives fits false and the compiler's message.

The figures measured with it are in the README (the rollout engine's decode memory, compiled ahead of time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from _helpers import parse_quick

QUICK = {"model": "tiny-dense", "slots": 4, "max_seq_len": 32, "page_size": 8}
TARGET_NAMES = ("cpu", "h200", "v5p", "v5e", "v6e")


def parse_args(argv) -> argparse.Namespace:
    """Command line (`QUICK` fills what --quick leaves unset). Raises SystemExit on bad values."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aot", choices=TARGET_NAMES, required=True)
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    ap.add_argument("--model", default="smollm2-135m", help="a posttrain.model.presets name (shapes only)")
    ap.add_argument("--slots", type=int, default=64, help="S, sequences decoded together")
    ap.add_argument("--max-seq-len", type=int, default=80, help="prompt + reply tokens per sequence")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=0, help="pages in the pool (0: every slot at full length + 1)")
    ap.add_argument("--param-dtype", default="auto", help="weights' dtype (auto: float32)")
    ap.add_argument("--decode-chunk", type=int, default=0, help="decode steps per program (0: the engine's "
                                                                 "default for the target's platform)")
    args = parse_quick(ap, argv, QUICK)
    if min(args.slots, args.max_seq_len, args.page_size) < 1 or args.pages < 0 or args.decode_chunk < 0:
        raise SystemExit(f"--slots {args.slots}, --max-seq-len {args.max_seq_len}, --page-size {args.page_size} "
                         f"must be >= 1, --pages {args.pages} and --decode-chunk {args.decode_chunk} >= 0")
    return args


def _devices(target: str):
    import jax

    from posttrain.infra import aot

    if target == "cpu":
        return jax.devices("cpu")[:1], "cpu"
    return aot.target_devices(target)[:1], aot.TARGETS[target].platform


def abstract_inputs(cfg, settings, mesh, rules, steps: int = 1):
    """(graphdef, the decode step's abstract arguments after graphdef, in order) on `mesh` (replicated inputs,
    weights sharded by `rules`; nothing allocated)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import use_rules
    from posttrain.model.transformer import Transformer
    from posttrain.generate import kv_pages

    rep = NamedSharding(mesh, PartitionSpec())
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    with jax.set_mesh(mesh), use_rules(rules):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        shardings = mesh_lib.state_shardings(state, mesh, rules)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        pool = jax.tree.map(lambda s: sds(s.shape, s.dtype),
                            kv_pages.pool_shapes(graphdef, state, settings.num_pages, settings.page_size))
    S, M = settings.num_slots, settings.pages_per_seq
    from posttrain.generate.engine.loop import Request, request_rows

    rows = jax.tree.map(lambda x: sds(x.shape, x.dtype),  # the engine's own per-row arrays, by shape
                        jax.eval_shape(lambda: request_rows([Request(prompt=(0,), max_new_tokens=1)] * S)))
    i32 = lambda: sds((S,), jnp.int32)
    return graphdef, (state, pool, sds((S, M), jnp.int32), i32(), i32(), rows, sds((steps, S), jnp.float32), i32(),
                      sds((S, 1), jnp.int32))


def compile_decode(cfg, settings, mesh, rules, impl: str, steps: int):
    """(MemoryReport, generated code bytes, compile seconds, pool bytes, weights bytes) of `decode_chunk` (`steps`
    decode steps)."""
    import jax

    from posttrain.infra import aot
    from posttrain.infra.partitioning import use_rules
    from posttrain.recipes.plan import per_device_bytes
    from posttrain.generate import kv_pages
    from posttrain.generate.engine.ops import decode_chunk

    graphdef, args = abstract_inputs(cfg, settings, mesh, rules, steps)
    with jax.set_mesh(mesh), use_rules(rules):
        lowered = decode_chunk.lower(graphdef, *args, impl=impl, steps=steps)
        compiled, report, seconds = aot.compile_with_report(lowered)
    code = compiled.memory_analysis().generated_code_size_in_bytes
    pool_bytes = kv_pages.pool_bytes(args[1])
    return report, code, seconds, pool_bytes, per_device_bytes(args[0])


def compile_or_reference(cfg, settings, mesh, impl: str, steps: int):
    """(impl compiled, the kernel's error or None, `compile_decode`'s results): `impl`, or the gather reference when
    the kernel cannot be built here (a RESOURCE_EXHAUSTED refusal is raised: the reference would not fit either)."""
    from posttrain.infra import mesh as mesh_lib

    try:
        return impl, None, compile_decode(cfg, settings, mesh, mesh_lib.RULES, impl, steps)
    except Exception as e:  # noqa: BLE001 - a kernel the target's compiler cannot build here: the reference
        if impl == "reference" or "RESOURCE_EXHAUSTED" in str(e):
            raise
        error = f"{impl}: {type(e).__name__}: {str(e)[:300]}"
    return "reference", error, compile_decode(cfg, settings, mesh, mesh_lib.RULES, "reference", steps)


def main(argv=None) -> dict:
    """Runs the compile (see the module doc); prints and returns its JSON. Raises SystemExit when the target's
    compiler is missing (the message names the install command)."""
    args = parse_args(argv)
    if args.aot != "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from posttrain.infra import aot
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.precision import resolve_policy
    from posttrain.model.presets import get_preset
    from posttrain.generate.engine.ops import EngineSettings
    from posttrain.generate.paged_attention import resolve_impl

    try:
        devices, platform = _devices(args.aot)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    policy = resolve_policy("auto", args.param_dtype, backend=platform)
    cfg = get_preset(args.model, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    pages_per_seq = math.ceil(args.max_seq_len / args.page_size)
    settings = EngineSettings(num_slots=args.slots, num_pages=args.pages or args.slots * pages_per_seq + 1,
                              page_size=args.page_size, max_seq_len=args.max_seq_len,
                              decode_chunk=args.decode_chunk)
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1, "expert": 1}, devices=devices)
    impl = resolve_impl("auto", platform)
    steps = settings.chunk_steps(platform)
    out = {"aot": args.aot, "device": str(devices[0].device_kind), "model": args.model, "slots": args.slots,
           "max_seq_len": args.max_seq_len, "page_size": args.page_size, "num_pages": settings.num_pages,
           "decode_chunk": steps,
           "compute_dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}
    hbm = aot.TARGETS[args.aot].hbm_bytes if args.aot != "cpu" else None
    if hbm:
        out["hbm_gib"] = round(hbm / aot.GIB, 1)
    try:
        impl, error, (report, code, seconds, pool_bytes, weight_bytes) = compile_or_reference(cfg, settings, mesh,
                                                                                              impl, steps)
    except Exception as e:  # noqa: BLE001 - XLA refuses a program larger than the device: the verdict
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        out.update(attention_impl=impl, fits=False, compiler_refused=str(e)[:300])
        print(json.dumps(out))
        return out
    g = lambda b: round(b / aot.GIB, 6)
    out.update({"attention_impl": impl, "kernel_error": error, "pool_bytes": int(pool_bytes),
                "pool_gib": g(pool_bytes), "weights_gib": g(weight_bytes), "generated_code_bytes": int(code),
                **report.as_dict(), "compile_s": round(seconds, 2)})
    if hbm:
        out["fits"] = aot.fits(report.peak, hbm)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
