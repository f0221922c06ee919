"""Run in a subprocess by test_expert_parallel.py (8 fake CPU devices must be configured before jax is imported).

Usage: python _expert_parallel.py OUT.json
Compares the expert-parallel all-to-all dispatch of `posttrain.model.moe` with the single-device computation:
values and gradients (x, router, the three expert weights) of a MoE layer for softmax top-k, sigmoid group-limited
routing with a shared expert, and hand-made assignments (skewed loads, idle experts, an overflowing shard under a
small ep_capacity_factor, checked against a NumPy count of the rows over capacity), for the fixed-capacity
all-to-all and the ragged one (`jax.lax.ragged_all_to_all` replaced by `helpers.emulated_ragged_all_to_all`:
XLA:CPU has no ragged all-to-all). Writes one JSON object of
max-abs differences and counts per case. Dimension legend as in moe.py (M tokens, k experts per token, E experts).
"""
import json
import math
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.infra import mesh as mesh_lib  # noqa: E402
from posttrain.model import moe as moe_lib  # noqa: E402
from posttrain.model.config import MoEConfig  # noqa: E402
from posttrain.infra.partitioning import use_rules  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from helpers import emulated_ragged_all_to_all  # noqa: E402

MESHES = {"ep8": {"expert": 8}, "dp2-ep4": {"data": 2, "expert": 4},
          "fsdp2-ep2-tp2": {"fsdp": 2, "expert": 2, "tensor": 2}}
E, D, F, M = 16, 16, 8, 64
NO_DROP = 8.0  # ep_capacity_factor >= expert shards: C = m*k, nothing can overflow (overflow: dispatch_case)
ROUTINGS = {"softmax-top2": MoEConfig(num_experts=E, num_experts_per_tok=2, expert_mlp_dim=F),
            "sigmoid-groups-shared": MoEConfig(num_experts=E, num_experts_per_tok=4, expert_mlp_dim=F,
                                               scoring="sigmoid", num_groups=4, topk_groups=2, num_shared_experts=1,
                                               routed_scaling_factor=2.5)}
REPLICATED_TOKENS = mesh_lib.rules_with_overrides({"batch": ("data", "fsdp")})  # tokens replicated over 'expert'


def maxdiff(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


_REFS = {}


def moe_case(cfg, mesh, rules=mesh_lib.RULES, shape=(4, M // 4)):
    """MoE layer value + gradients w.r.t. x and every parameter (router, experts, shared MLP): mesh vs none.
    shape: [B, T] of the tokens."""
    layer = MoE_(cfg)
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), shape + (D,), jnp.float32)
    g = jax.random.normal(jax.random.key(2), shape + (D,), jnp.float32)
    valid = jnp.ones(shape, bool)

    def loss(s, x):
        y, aux = nnx.merge(graphdef, s)(x, valid)
        return (y * g).sum(), (y, aux["ep_dropped_frac"])

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    if (id(cfg), shape) not in _REFS:  # the single-device reference, once per routing and shape
        _REFS[id(cfg), shape] = f(state, x)
    (_, (y0, _)), g0 = _REFS[id(cfg), shape]
    with jax.set_mesh(mesh), use_rules(rules):
        (_, (y1, drop)), g1 = f(state, x)
    return {"fwd": maxdiff(y0, y1), "grad": maxdiff(g0, g1), "dropped": float(drop),
            "ref_std": float(np.std(np.asarray(y0)))}


def MoE_(cfg):
    return moe_lib.MoE(d_model=D, moe=cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                       ep_capacity_factor=NO_DROP)


def expected_keep(experts_Mxk, blocks, S, cf):
    """NumPy: which assignments fit, with M split into `blocks` source shards (first C rows per destination)."""
    M_, k = experts_Mxk.shape
    m = M_ // blocks
    C = min(m * k, max(1, math.ceil(cf * m * k / S)))
    dest = (experts_Mxk // (E // S)).reshape(blocks, m * k)
    keep = np.zeros_like(dest, bool)
    for b in range(blocks):
        seen = np.zeros(S, int)
        for r in range(m * k):
            keep[b, r] = seen[dest[b, r]] < C
            seen[dest[b, r]] += 1
    return keep.reshape(M_, k)


def expected_keep_ragged(experts_Mxk, blocks, S, cf):
    """NumPy, ragged form: each group of S consecutive source blocks (shard order) shares one exchange; a source
    sends its rows sorted by expert (stable) and expert shard j takes the first R = ceil(cf*m*k) of them in
    (source, sorted row) order."""
    M_, k = experts_Mxk.shape
    m = M_ // blocks
    n = m * k
    R = min(S * n, max(1, math.ceil(cf * n)))
    flat = experts_Mxk.reshape(blocks, n)
    keep = np.zeros_like(flat, bool)
    for g in range(0, blocks, S):
        taken = np.zeros(S, int)
        for b in range(g, g + S):
            for r in np.argsort(flat[b], kind="stable"):
                j = flat[b, r] // (E // S)
                keep[b, r] = taken[j] < R
                taken[j] += 1
    return keep.reshape(M_, k)


def dispatch_case(mesh, blocks, S, cf, skew, ragged=False):
    """Hand-made assignments: `skew` of the rows go to expert shard 0's experts; experts 5 and the last shard's
    experts get none. Returns diffs vs `expert_ffn` without the dropped assignments, and the dropped fractions."""
    rng = np.random.default_rng(3)
    El = E // S
    allowed = [e for e in range(E) if e != 5 and e // El != S - 1]
    experts = np.stack([rng.permutation(allowed)[:2] for _ in range(M)]).astype(np.int32)
    hot = rng.random((M, 2)) < skew
    experts = np.where(hot, np.array([0, 1]), experts).astype(np.int32)  # experts 0 and 1 live on shard 0
    weights = rng.random((M, 2)).astype(np.float32)
    ks = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(ks[0], (M, D))
    wg, wu = (jax.random.normal(k_, (E, D, F)) / 4 for k_ in ks[1:3])
    wd = jax.random.normal(ks[3], (E, F, D)) / 3
    g = jax.random.normal(ks[4], (M, D))
    keep = (expected_keep_ragged if ragged else expected_keep)(experts, blocks, S, cf)
    kw = dict(ep_impl="ragged", _ragged_impl=emulated_ragged_all_to_all) if ragged else {}

    def ref(x, w, wg, wu, wd):
        y = moe_lib.expert_ffn(x, jnp.asarray(experts), w * keep, wg, wu, wd, jnp.float32)
        return (y * g).sum(), (y, 0.0)

    def ep(x, w, wg, wu, wd):
        y, drop = moe_lib.dispatch(x, jnp.asarray(experts), w, wg, wu, wd, jnp.float32, ep_capacity_factor=cf,
                                   **kw)
        return (y * g).sum(), (y, drop)

    args = (x, jnp.asarray(weights), wg, wu, wd)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=tuple(range(5)), has_aux=True))
    (_, (y0, _)), g0 = grad(ref)(*args)
    with jax.set_mesh(mesh):
        (_, (y1, drop)), g1 = grad(ep)(*args)
    load0 = float((experts // El == 0).mean())
    return {"fwd": maxdiff(y0, y1), "grad": maxdiff(g0, g1),
            "dropped": float(drop), "expected_dropped": float(1 - keep.mean()), "shard0_load": load0,
            "idle_shard_load": float((experts // El == S - 1).mean())}


def main(out_path):
    jax.config.update("jax_default_matmul_precision", "highest")
    res = {"num_devices": jax.device_count(), "cases": {}}
    t0 = time.perf_counter()

    def record(name, case):
        nonlocal t0
        res["cases"][name] = dict(case, seconds=round(time.perf_counter() - t0, 2))
        t0 = time.perf_counter()

    for mname, sizes in MESHES.items():
        mesh = mesh_lib.make_mesh(sizes)
        S = sizes["expert"]
        blocks = sizes.get("data", 1) * sizes.get("fsdp", 1) * S
        if mname == "ep8":  # the other meshes: the (skewed) overflow only, which compares values and gradients too
            for rname, cfg in ROUTINGS.items():
                record(f"{mname}/{rname}", moe_case(cfg, mesh))
            record(f"{mname}/skewed", dispatch_case(mesh, blocks, S, cf=float(S), skew=0.6))
            # the ragged bookkeeping, with an all_to_all stand-in for the collective
            record(f"{mname}/ragged-overflow", dispatch_case(mesh, blocks, S, cf=0.75, skew=0.6, ragged=True))
        record(f"{mname}/overflow", dispatch_case(mesh, blocks, S, cf=0.75, skew=0.6))
    mesh = mesh_lib.make_mesh(MESHES["dp2-ep4"])
    record("dp2-ep4-replicated/softmax-top2", moe_case(ROUTINGS["softmax-top2"], mesh, REPLICATED_TOKENS))
    # a decode step: one token, replicated (the dropless all-gather / psum form)
    record("ep8-decode/softmax-top2", moe_case(ROUTINGS["softmax-top2"], mesh_lib.make_mesh(MESHES["ep8"]),
                                               shape=(1, 1)))
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
