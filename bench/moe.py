"""One MoE layer, forward + backward, per grouped-matmul implementation, beside a dense matmul of the same FLOPs.

The layer is `posttrain.model.moe`'s routed expert MLP at a chosen shape (default: one `qwen3-30b-a3b` layer,
d_model 2048, 128 experts, top-8, expert MLP 768) on --tokens tokens: softmax top-k routing, sort by expert,
three grouped matmuls (gate, up, down), weighted combine; gradients w.r.t. the tokens, the router and the three
expert weights. The peer, measured in the same process, is the same MLP as plain dense matmuls over the
tokens x k rows (one expert, no routing): identical matmul FLOPs, the speed a grouped matmul should approach.

  python bench/moe.py --json                                  # every implementation that fits this backend
  python bench/moe.py --tokens 2048 --impls ragged,padded     # quicker on a CPU
  python bench/moe.py --quick --json                          # seconds: `QUICK` shapes, one timed step
  python bench/moe.py --aot h200 --json                       # compile for an H200 here: temp memory per impl

Every variant is compiled first; one whose peak memory (`memory_analysis()`: arguments + outputs + temporaries)
does not fit the backend (`posttrain.infra.aot.fits` of the free memory: the device's limit, on a CPU the
host's MemAvailable; --max-gib overrides) is not run but reported as skipped with what it needs ("ragged" at the
default shape needs ~550 GiB on a CPU: XLA's CPU ragged_dot expands across all 128 groups).
Prints one JSON line with --json: per implementation, seconds per step, tokens/s, TFLOP/s, peak GiB and the ratio
to the dense peer's throughput (or, with --aot, compile seconds and per-device temp GiB from `memory_analysis()`).
"megablox" runs only on a TPU (off TPU it is the Pallas interpreter: a correctness tool, not a speed path).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))

from _helpers import compile_variants, free_bytes, gib, parse_quick, time_variants  # noqa: E402

QUICK = {"tokens": 256, "d_model": 64, "experts": 8, "top_k": 2, "expert_mlp": 32, "steps": 1}  # --quick shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-mlp", type=int, default=768)
    ap.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 elsewhere)|float32|bfloat16")
    ap.add_argument("--impls", default="", help="comma list of posttrain.model.gmm.IMPLS (default: all that run)")
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="for the 'capacity' implementation")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--aot", default="", choices=("", "h200", "v5p"), help="compile for this chip; do not run")
    ap.add_argument("--max-gib", type=float, default=0.0,
                    help="memory a variant may use (0: the backend's free memory); larger ones are skipped")
    ap.add_argument("--json", action="store_true")
    return parse_quick(ap, argv, QUICK)


def layer_loss(impl, dtype, capacity_factor, k):
    """loss(x, router, wg, wu, wd, ct) of one routed-expert MLP; impl "dense" is the peer (no routing)."""
    import jax
    import jax.numpy as jnp

    from posttrain.model import moe

    def loss(x, router, wg, wu, wd, ct):
        if impl == "dense":  # same matmul FLOPs: the tokens x k rows through one expert
            xs = jnp.repeat(x, k, axis=0).astype(dtype)
            g = jnp.dot(xs, wg[0].astype(dtype), preferred_element_type=jnp.float32)
            u = jnp.dot(xs, wu[0].astype(dtype), preferred_element_type=jnp.float32)
            h = (jax.nn.silu(g) * u).astype(dtype)
            y = jnp.dot(h, wd[0].astype(dtype), preferred_element_type=jnp.float32)
            return jnp.sum(y.reshape(x.shape[0], k, -1).sum(1) * ct)
        logits = jnp.dot(x.astype(jnp.float32), router)
        weights, experts, _ = moe.route(logits, None, k=k, scoring="softmax", norm_topk_prob=True,
                                        routed_scaling_factor=1.0)
        y = moe.expert_ffn(x, experts, weights, wg, wu, wd, dtype, impl="auto" if impl == "capacity" else impl,
                           capacity_factor=capacity_factor if impl == "capacity" else None)
        return jnp.sum(y * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def inputs(args, dtype, sharding=None):
    import jax
    import jax.numpy as jnp

    M, D, E, F = args.tokens, args.d_model, args.experts, args.expert_mlp
    shapes = [((M, D), dtype), ((D, E), jnp.float32), ((E, D, F), dtype), ((E, D, F), dtype), ((E, F, D), dtype),
              ((M, D), jnp.float32)]
    if sharding is not None:
        return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    keys = jax.random.split(jax.random.key(0), len(shapes))
    scale = [1.0, D ** -0.5, D ** -0.5, D ** -0.5, F ** -0.5, 1.0]
    return [(jax.random.normal(kk, s, jnp.float32) * c).astype(d) for kk, (s, d), c in zip(keys, shapes, scale)]


def flops(args) -> float:
    """Matmul FLOPs of forward + backward: 3 matmuls of 2 * rows * D * F each, times 3 (forward, two grads)."""
    return 3 * 3 * 2 * args.tokens * args.top_k * args.d_model * args.expert_mlp


def main(argv=None):
    args = parse_args(argv)
    if args.aot:
        from grpo_step import _reexec_in_aot_venv

        if argv is None:
            _reexec_in_aot_venv(args.aot, __file__)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from posttrain.infra import aot
    from posttrain.model import gmm

    platform = {"h200": "gpu", "v5p": "tpu"}.get(args.aot, jax.default_backend())
    dtype = {"auto": jnp.float32 if platform == "cpu" else jnp.bfloat16, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[args.dtype]
    impls = args.impls.split(",") if args.impls else [
        i for i in gmm.IMPLS if i != "auto" and (i != "megablox" or platform == "tpu")]
    device = aot.target_devices(args.aot)[0] if args.aot else jax.devices()[0]
    budget = int(args.max_gib * aot.GIB) if args.max_gib else (aot.TARGETS[args.aot].hbm_bytes if args.aot
                                                                else free_bytes(device))
    out = {"shape": {"tokens": args.tokens, "d_model": args.d_model, "experts": args.experts, "top_k": args.top_k,
                     "expert_mlp": args.expert_mlp}, "dtype": jnp.dtype(dtype).name, "platform": platform,
           "auto": gmm.auto_impl(platform), "flops_per_step": flops(args), "memory_budget_gib": gib(budget),
           "quick": args.quick, "results": {}}
    specs = inputs(args, dtype, jax.sharding.SingleDeviceSharding(device))
    make = lambda impl: layer_loss(impl, dtype, args.capacity_factor, args.top_k)  # noqa: E731
    out["results"], compiled = compile_variants(make, impls, specs, budget, "dense", aot=bool(args.aot))
    xs = inputs(args, dtype) if compiled else []
    time_variants(out["results"], compiled, xs, args.steps, "dense", args.tokens, flops(args))
    if args.json:
        print(json.dumps(out))
    else:
        for impl, r in out["results"].items():
            print(impl, r)
    return out


if __name__ == "__main__":
    main()
