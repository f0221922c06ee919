"""Run in a subprocess by test_sharded_moe.py (8 fake CPU devices must be configured before jax is imported).

Usage: python _sharded_forward.py OUT.json [--full]
For tiny-moe and tiny-deepseek (random weights) on mesh data2 x fsdp2 x expert2 (params placed by
`load_hf_dir(..., mesh=mesh)`), compares sharded vs single-device logits, records where the expert weights
live and whether the expert-parallel shard_map path of `posttrain.model.moe.dispatch` ran. --full adds the
fsdp2 x expert2 x tensor2 mesh (params placed with device_put), greedy sampling under both meshes, and a model
created with `create_sharded`. Writes one JSON object.
"""
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.infra import mesh as mesh_lib  # noqa: E402
from posttrain.checkpoints.export import export_hf  # noqa: E402
from posttrain.checkpoints.load import load_hf_dir  # noqa: E402
from posttrain.model import moe as moe_lib  # noqa: E402
from posttrain.model.presets import get_preset  # noqa: E402
from posttrain.model.transformer import Transformer  # noqa: E402
from posttrain.infra.partitioning import create_sharded  # noqa: E402
from posttrain.generate.sampler import SamplingParams, sample  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from helpers import random_model  # noqa: E402

MESHES = {"dp2-fsdp2-ep2": {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1},
          "fsdp2-ep2-tp2": {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}}




def _placed(cfg, host_state, mesh_name, mesh):
    """The host state on `mesh`: through the checkpoint loader (dp2-fsdp2-ep2) or device_put to the rules'
    shardings (the other meshes)."""
    if mesh_name == "dp2-fsdp2-ep2":
        with tempfile.TemporaryDirectory() as d:
            export_hf(cfg, host_state, d)
            return load_hf_dir(d, mesh=mesh).state
    return jax.device_put(host_state, mesh_lib.state_shardings(host_state, mesh))


def _mesh_case(graphdef, state, mesh, x, fwd, gen, ref, ref_gen, calls):
    """One preset x mesh: where the gate weights live, the sharded forward (and with `gen`, greedy sampling)
    against the single-device reference, and the expert computations traced."""
    gate = state["moe_layers"]["ffn"]["gate_proj"].get_value()
    case = {"gate_spec": [None if a is None else a if isinstance(a, str) else list(a) for a in gate.sharding.spec],
            "gate_shape": list(gate.shape), "gate_shard_shape": list(gate.addressable_shards[0].data.shape)}
    calls.clear()
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, x))
        out = np.asarray(fwd(state, x))
        out_gen = gen(state) if ref_gen is not None else None
    case.update(fwd_max_diff=float(np.abs(out - ref).max()), ref_std=float(ref.std()),
                ref_max_abs=float(np.abs(ref).max()), shard_map_in_jaxpr="shard_map" in jaxpr,
                expert_calls=list(calls))
    if out_gen is not None:
        case.update(gen_tokens_equal=bool((np.asarray(out_gen.tokens_NxLg) == np.asarray(ref_gen.tokens_NxLg)).all()),
                    gen_logp_max_diff=float(np.abs(np.asarray(out_gen.logp_NxLg) -
                                                   np.asarray(ref_gen.logp_NxLg)).max()))
    return case


def _born_sharded_case(x):
    """Parameters born sharded (jitted init with out_shardings) run the same as their host copy."""
    cfg = get_preset("tiny-moe")
    mesh = mesh_lib.make_mesh(MESHES["dp2-fsdp2-ep2"])
    graphdef, born = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    born_ref = np.asarray(fwd(jax.device_get(born), x))
    with jax.set_mesh(mesh):
        born_out = np.asarray(fwd(born, x))
    return {"max_diff": float(np.abs(born_out - born_ref).max()),
            "gate_spec": str(born["moe_layers"]["ffn"]["gate_proj"].get_value().sharding.spec)}


def main(out_path, full):
    calls = []
    plain_ffn = moe_lib.expert_ffn

    def recording_ffn(*args, expert_offset=0, **kw):  # records each trace of the expert computation
        calls.append({"traced_offset": isinstance(expert_offset, jax.core.Tracer), "local_experts": args[3].shape[0],
                      "tokens": args[0].shape[0]})
        return plain_ffn(*args, expert_offset=expert_offset, **kw)

    moe_lib.expert_ffn = recording_ffn
    results = {"num_devices": jax.device_count(), "full": full, "cases": {}}
    x = np.random.default_rng(1).integers(0, 128, (8, 16)).astype(np.int32)
    prompts = np.random.default_rng(2).integers(3, 128, (4, 8)).astype(np.int32)
    lengths = np.array([8, 5, 7, 3], np.int32)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    meshes = MESHES if full else {k: v for k, v in MESHES.items() if k == "dp2-fsdp2-ep2"}
    for preset in ("tiny-moe", "tiny-deepseek"):
        cfg, graphdef, host_state = random_model(preset, std=0.1)
        fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
        gen = lambda s: sample(graphdef, s, jnp.asarray(prompts), jnp.asarray(lengths), jax.random.key(0),
                               group_size=2, params=params, stop_ids=(1,), pad_id=0)
        calls.clear()
        ref = np.asarray(fwd(host_state, x))
        # float32 noise floor on ONE device: a row run alone vs in the batch of 8 (CPU matmul kernels round
        # differently for other batch shapes, which is also what a sharded batch sees)
        noise_floor = float(np.abs(np.asarray(fwd(host_state, x[:1])) - ref[:1]).max())
        ref_gen = gen(host_state) if full else None
        unsharded_calls = list(calls)
        for mesh_name, sizes in meshes.items():
            mesh = mesh_lib.make_mesh(sizes)
            state = _placed(cfg, host_state, mesh_name, mesh)
            case = _mesh_case(graphdef, state, mesh, x, fwd, gen, ref, ref_gen, calls)
            case.update(single_device_batch1_vs_batch8=noise_floor, unsharded_calls=unsharded_calls)
            results["cases"][f"{preset}/{mesh_name}"] = case
    if full:
        results["cases"]["tiny-moe/create_sharded"] = _born_sharded_case(x)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], full="--full" in sys.argv[2:])
