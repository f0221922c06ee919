"""Per-device temporary memory of one expert-parallel MoE layer, compiled ahead of time for TPU v5p.

    .venv-aot/bin/python bench/moe_ep_memory.py --json [--eps 4,8,16] [--tokens 4096]
        [--impls all_to_all,ragged,all_gather] [--gmm-impl ragged] [--capacity-factor 2.0]
    python bench/moe_ep_memory.py --quick --json    # seconds: `QUICK` layer and EPs on fake CPU devices

--quick compiles the same layer at `QUICK`'s tiny shape for fake CPU devices (XLA's host platform split into
max(EPs) devices, set before JAX starts), so it needs no libtpu; its bytes say nothing about a TPU, and it leaves
out "ragged" (XLA:CPU cannot compile ragged-all-to-all).

Workload: one `qwen3-30b-a3b` MoE layer (d_model D 2048, E 128 experts, top-k 8, expert MLP F 768, softmax routing),
bf16 parameters and compute, `--tokens` tokens per device. Forward and backward (gradients w.r.t. the tokens, the
router and the three expert weights) of sum(y * g) for a fixed cotangent g, under `jax.jit` on a mesh whose only
non-trivial axis is 'expert' = EP (the default rules then split the tokens over the same axis and the experts
E/EP per device). Devices: the v5p topology with EP chips (`posttrain.recipes.plan.target_devices("v5p-<2*EP>")`; needs
libtpu, e.g. `.venv-aot` with `libtpu==0.0.42.*`). Nothing runs; only `compiled.memory_analysis()` is read.

Implementations (`posttrain.model.moe.dispatch(ep_impl=...)`): "all_to_all" (fixed send capacity
`--capacity-factor`, default MoEConfig's 2.0), "ragged" (`jax.lax.ragged_all_to_all`, receive capacity from the
same factor) and "all_gather" (every token gathered onto every expert shard, then reduce-scattered; the form used
before the all-to-all). --gmm-impl: the grouped matmul inside `expert_ffn` (`posttrain.model.gmm.IMPLS`; default
"ragged" = `jax.lax.ragged_dot`; "auto" follows the mesh's platform: megablox on TPU). Prints ONE JSON line:
{"tokens_per_device", "capacity_factor", "gmm_impl", "temp_bytes": {impl: {EP: bytes}}, "temp_gib": ...,
 "peak_gib": ..., "compile_s": ..., "spread": {impl: max/min - 1 over EP},
 "ratio_to_all_gather": {impl: {EP: temp / all_gather's temp}} (when all_gather ran: the form it replaced)}.

The figures measured with it are in the README (MoE: expert parallelism's per-device memory).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from _helpers import parse_quick  # noqa: E402

LAYER = {"D": 2048, "E": 128, "K": 8, "F": 768}  # qwen3-30b-a3b: d_model, experts, top-k, expert MLP
# --quick on fake CPU devices ("ragged": XLA:CPU has no ragged-all-to-all)
QUICK = {"layer": {"D": 64, "E": 8, "K": 2, "F": 32}, "eps": "2,4", "tokens": 16, "impls": "all_to_all,all_gather"}
_EXPERT_FFN = None


def target_devices(ep: int, quick: bool) -> list:
    """`ep` devices: the v5p topology with EP chips, or with `quick` the first `ep` (fake) CPU devices."""
    import jax

    from posttrain.recipes import plan

    devices = jax.devices("cpu")[:ep] if quick else plan.target_devices(f"v5p-{2 * ep}")[0]
    assert len(devices) == ep, (ep, len(devices))
    return devices


def compile_layer(ep: int, tokens_per_device: int, impl: str, capacity_factor: float, gmm_impl: str,
                  layer: dict = LAYER, quick: bool = False):
    """(memory_analysis, compile seconds) of one MoE layer's forward + backward at expert parallelism `ep`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from posttrain.infra import mesh as mesh_lib
    from posttrain.model import moe

    global _EXPERT_FFN
    _EXPERT_FFN = _EXPERT_FFN or moe.expert_ffn
    if gmm_impl != "auto":  # dispatch looks expert_ffn up at call time
        moe.expert_ffn = functools.partial(_EXPERT_FFN, impl=gmm_impl)
    D, E, K, F = layer["D"], layer["E"], layer["K"], layer["F"]
    mesh = mesh_lib.make_mesh({"expert": ep}, devices=target_devices(ep, quick))
    M = tokens_per_device * ep
    bf = jnp.bfloat16

    def loss(x, router, wg, wu, wd, g):
        logits = jnp.einsum("md,de->me", x.astype(jnp.float32), router.astype(jnp.float32))
        w, e, _ = moe.route(logits, None, k=K, scoring="softmax", norm_topk_prob=True, routed_scaling_factor=1.0)
        y, _ = moe.dispatch(x, e, w, wg, wu, wd, bf, ep_capacity_factor=capacity_factor, ep_impl=impl)
        return (y * g).sum()

    sh = lambda *spec: NamedSharding(mesh, P(*spec))
    args = (jax.ShapeDtypeStruct((M, D), bf, sharding=sh("expert", None)),
            jax.ShapeDtypeStruct((D, E), bf, sharding=sh(None, None)),
            jax.ShapeDtypeStruct((E, D, F), bf, sharding=sh("expert", None, None)),
            jax.ShapeDtypeStruct((E, D, F), bf, sharding=sh("expert", None, None)),
            jax.ShapeDtypeStruct((E, F, D), bf, sharding=sh("expert", None, None)),
            jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=sh("expert", None)))
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args)
        t = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t
    return compiled.memory_analysis(), seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line (the only output format)")
    ap.add_argument("--eps", default="4,8,16")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    ap.add_argument("--impls", default="all_to_all,ragged,all_gather")
    ap.add_argument("--gmm-impl", default="ragged", help="grouped matmul of expert_ffn (posttrain.model.gmm.IMPLS)")
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    a = parse_quick(ap, argv, {k: v for k, v in QUICK.items() if k != "layer"},
                    help=f"{QUICK} on fake CPU devices unless given")
    eps = [int(v) for v in a.eps.split(",")]
    if a.quick and "jax" not in sys.modules:  # fake CPU devices, before JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(eps)}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    layer = QUICK["layer"] if a.quick else LAYER
    out = {"tokens_per_device": a.tokens, "capacity_factor": a.capacity_factor, "gmm_impl": a.gmm_impl,
           "layer": layer, "devices": "fake cpu" if a.quick else "v5p", "temp_bytes": {}, "temp_gib": {},
           "peak_gib": {}, "compile_s": {}, "spread": {}}
    for impl in a.impls.split(","):
        for key in ("temp_bytes", "temp_gib", "peak_gib", "compile_s"):
            out[key][impl] = {}
        for ep in eps:
            m, s = compile_layer(ep, a.tokens, impl, a.capacity_factor, a.gmm_impl, layer, a.quick)
            peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
            out["temp_bytes"][impl][ep] = m.temp_size_in_bytes
            out["temp_gib"][impl][ep] = round(m.temp_size_in_bytes / 2**30, 3)
            out["peak_gib"][impl][ep] = round(peak / 2**30, 3)
            out["compile_s"][impl][ep] = round(s, 1)
        temps = list(out["temp_bytes"][impl].values())
        out["spread"][impl] = round(max(temps) / min(temps) - 1, 4)
    peer = out["temp_bytes"].get("all_gather")
    if peer:
        out["ratio_to_all_gather"] = {impl: {ep: round(b / peer[ep], 4) for ep, b in by_ep.items()}
                                      for impl, by_ep in out["temp_bytes"].items()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
