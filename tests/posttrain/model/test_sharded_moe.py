"""Tiny MoE models (tiny-moe: softmax top-k; tiny-deepseek: MLA + sigmoid group-limited routing + shared expert)
on 8 fake CPU devices. Default: mesh data2 x fsdp2 x expert2 gives the single-device logits (<= 1e-5), the expert
weights are split over the 'expert' axis, and the expert-parallel shard_map path of `moe.dispatch` is what runs.
Slow: the same plus a fsdp2 x expert2 x tensor2 mesh, greedy sampling under both meshes, and create_sharded.

The fake devices need XLA_FLAGS before jax is imported, so the work runs in a subprocess
(`_sharded_forward.py`, one JSON result per mode) shared by the tests of this module.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import fake_devices_flags

SCRIPT = pathlib.Path(__file__).with_name("_sharded_forward.py")
MESHES = ("dp2-fsdp2-ep2", "fsdp2-ep2-tp2")
PRESETS = ("tiny-moe", "tiny-deepseek")
E = 8  # experts in both presets


def _run(tmp_path_factory, full):
    out = tmp_path_factory.mktemp("sharded") / "result.json"
    env = dict(os.environ, XLA_FLAGS=fake_devices_flags(8), JAX_PLATFORMS="cpu")
    repo = pathlib.Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), str(out)] + ["--full"] * full, env=env,
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"sharded subprocess timed out after {e.timeout} s")
    assert proc.returncode == 0, f"sharded subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["num_devices"] == 8 and r["full"] == full
    return r["cases"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return _run(tmp_path_factory, full=False)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _run(tmp_path_factory, full=True)


def _check_case(case, preset, mesh):
    assert case["ref_std"] > 0.5, "random weights too small for a meaningful comparison"
    assert case["fwd_max_diff"] <= 1e-5, case
    # expert weights [layers, E, D, F]: E over 'expert' (2), D over 'fsdp' (2), F over 'tensor'
    L, n_exp, D, F = case["gate_shape"]
    assert n_exp == E and case["gate_spec"] == [None, "expert", "fsdp", "tensor"]
    tensor = 2 if mesh.endswith("tp2") else 1
    assert case["gate_shard_shape"] == [L, E // 2, D // 2, F // tensor]
    # the expert-parallel path ran: every trace of expert_ffn under the mesh is inside shard_map with a traced
    # expert offset and E/2 local experts; without a mesh it sees all experts with offset 0
    assert case["shard_map_in_jaxpr"]
    calls, plain = case["expert_calls"], case["unsharded_calls"]
    assert calls and all(c["traced_offset"] and c["local_experts"] == E // 2 for c in calls), calls
    assert plain and all(not c["traced_offset"] and c["local_experts"] == E for c in plain), plain


@pytest.mark.parametrize("preset", PRESETS)
def test_expert_parallel_forward_matches_single_device(quick, preset):
    """Mesh data2 x fsdp2 x expert2, params placed sharded by load_hf_dir(mesh=...)."""
    _check_case(quick[f"{preset}/dp2-fsdp2-ep2"], preset, "dp2-fsdp2-ep2")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_forward_and_sampling_full(full, preset, mesh):
    """Adds the tensor=2 mesh and greedy sampling (decode batch smaller than the mesh) under both meshes."""
    case = full[f"{preset}/{mesh}"]
    _check_case(case, preset, mesh)
    assert case["gen_tokens_equal"] and case["gen_logp_max_diff"] <= 1e-5, case


@pytest.mark.slow
def test_create_sharded_model_runs_sharded(full):
    case = full["tiny-moe/create_sharded"]
    assert case["gate_spec"] == "P(None, 'expert', 'fsdp', 'tensor')"
    assert case["max_diff"] <= 1e-5, case
