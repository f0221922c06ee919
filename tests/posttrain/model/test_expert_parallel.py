"""Expert parallelism by all-to-all (`posttrain.model.moe.dispatch`) on 8 fake CPU devices equals the
single-device MoE: values and gradients (x, router, expert weights, shared expert) <= 1e-5 in float32 at
"highest" matmul precision, for softmax top-k and sigmoid group-limited routing (+ a shared expert), skewed
loads within capacity, an idle expert shard, and an overflowing shard under a small ep_capacity_factor (the
dropped fraction equals a NumPy count and the output equals the reference without exactly those assignments).
Meshes: expert8, data2 x expert4 (also with tokens replicated over 'expert'), fsdp2 x expert2 x tensor2; a decode
step of one token (the all-gather fallback).

The fake devices need XLA_FLAGS before jax is imported, so the work runs in one subprocess
(`_expert_parallel.py`, one JSON object) shared by the tests of this module.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import fake_devices_flags

SCRIPT = pathlib.Path(__file__).with_name("_expert_parallel.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "result.json"
    env = dict(os.environ, XLA_FLAGS=fake_devices_flags(8), JAX_PLATFORMS="cpu")
    repo = pathlib.Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"expert-parallel subprocess timed out after {e.timeout} s")
    assert proc.returncode == 0, f"expert-parallel subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["num_devices"] == 8
    return r["cases"]


@pytest.mark.parametrize("name", ["ep8/softmax-top2", "ep8/sigmoid-groups-shared", "dp2-ep4-replicated/softmax-top2",
                                  "ep8-decode/softmax-top2"])
def test_moe_layer_matches_single_device(cases, name):
    """MoE layer (router, routing, dispatch, shared expert) with a capacity that cannot overflow; decode: one
    token, replicated over the mesh (the all-gather / psum fallback); replicated: data2 x expert4 with tokens
    replicated over 'expert' (each expert shard takes a slice)."""
    c = cases[name]
    assert c["ref_std"] > 0.05, c
    assert c["fwd"] <= TOL and c["grad"] <= TOL and c["dropped"] == 0.0, c


def test_skewed_load_and_idle_shard_within_capacity(cases):
    """Expert 5 and the last shard's experts get no rows, shard 0 most of them (ep_capacity_factor = S)."""
    c = cases["ep8/skewed"]
    assert c["shard0_load"] > 0.6 and c["idle_shard_load"] == 0.0, c
    assert c["dropped"] == 0.0 == c["expected_dropped"], c
    assert c["fwd"] <= TOL and c["grad"] <= TOL, c


@pytest.mark.parametrize("mesh", ["ep8", "dp2-ep4", "fsdp2-ep2-tp2"])
def test_overflow_drops_exactly_the_rows_over_capacity(cases, mesh):
    """ep_capacity_factor 0.75: the fraction dropped is the NumPy count, the output (and its gradients) the
    reference with exactly those assignments' weights set to 0."""
    c = cases[f"{mesh}/overflow"]
    assert c["dropped"] > 0.1 and c["dropped"] == pytest.approx(c["expected_dropped"], abs=1e-7), c
    assert c["fwd"] <= TOL and c["grad"] <= TOL, c


@pytest.mark.parametrize("mesh", ["ep8"])
def test_ragged_overflow_drops_exactly_the_rows_over_capacity(cases, mesh):
    """The ragged exchange's bookkeeping (offsets, sizes, pooled receive capacity), with an all_to_all-based
    stand-in for `jax.lax.ragged_all_to_all` (XLA:CPU has none); its drops are the NumPy count."""
    c = cases[f"{mesh}/ragged-overflow"]
    assert c["dropped"] > 0.05 and c["dropped"] == pytest.approx(c["expected_dropped"], abs=1e-7), c
    assert c["fwd"] <= TOL and c["grad"] <= TOL, c
