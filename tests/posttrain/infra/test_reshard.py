"""Split meshes (`mesh.rollout`): the rollout submesh's validation (one-line ConfigErrors), the transfer-bytes count,
and on 8 fake CPU devices (`_split_mesh.py`, one subprocess for the module): the tiny model sampled on a 2-device
rollout submesh through the rollout queue's weight transfer gives the unsplit run's tokens (same seed, float32, two
policy versions), the resharded params equal the learner's, the transfer bytes equal a hand count, and
`posttrain plan` of the split topology compiles both programs."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import fake_devices_flags, tiny_config
from posttrain.config import ConfigError
from posttrain.infra import mesh as mesh_lib, reshard
from posttrain.config.plan import make_run_plan

SCRIPT = pathlib.Path(__file__).with_name("_split_mesh.py")
ROOT = pathlib.Path(__file__).resolve().parents[3]
# tiny-dense with the byte tokenizer's 320 ids: V, D, layers, heads, kv heads, head dim, MLP width (presets.py)
V, D, L, H, K, HD, F = 320, 64, 2, 4, 2, 16, 128


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("split") / "result.json"
    env = dict(os.environ, XLA_FLAGS=fake_devices_flags(8), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"split-mesh subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def hand_count_bytes() -> int:
    """float32 bytes the rollout submesh (tensor 2, data 1) receives per version, counted by hand: every parameter
    once (embedding V x D; per layer q, k, v, o, gate, up, down and two norms; the final norm), plus a second copy
    of what tensor does not split (the norms: replicated on both rollout devices)."""
    params = V * D + L * (D * H * HD + 2 * D * K * HD + H * HD * D + 3 * D * F + 2 * D) + D
    replicated = L * 2 * D + D
    return 4 * (params + replicated)


def test_split_sampling_equals_the_unsplit_run(split):
    assert split["learner_mesh"] == {"data": 3, "fsdp": 2, "tensor": 1, "expert": 1}
    assert split["rollout_mesh"] == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 1}
    assert split["learner_devices"] == [0, 1, 2, 3, 4, 5] and split["rollout_devices"] == [6, 7]
    assert split["producer_on_rollout"] == [True, True]  # the queue handed the sampler weights on its own devices
    assert split["tokens_equal"] == [True, True], split["logp_max_diff"]  # versions 0 and 1
    assert split["logp_max_diff"] < 1e-4
    assert split["sync_s"] > 0


def test_resharded_params_equal_the_learners_in_the_inference_layout(split):
    assert split["params_equal"] and split["synced_on_rollout"]
    q, emb, norm = ("[0]['dense_layers']['attn']['q_proj'].value", "[0]['embedding'].value",
                    "[0]['dense_layers']['input_norm']['weight'].value")
    assert split["leaves"][q] == [[L, D, H, HD], "float32"]
    assert split["shard_shapes"][q] == [L, D, H // 2, HD]  # heads over tensor; embed whole (fsdp has size 1)
    assert split["shard_shapes"][emb] == [V // 2, D] and split["shard_shapes"][norm] == [L, D]
    assert split["same_devices_untouched"]  # a sampler sharing the learner's devices keeps the train layout


def test_transfer_bytes_equal_a_hand_count(split):
    assert split["transfer_bytes"] == hand_count_bytes() == 379392
    assert split["transfer_bytes_same_devices"] == 0


def test_split_plan_compiles_both_programs(split):
    p = split["plan"]
    assert p["devices"] == 8 and p["mesh"] == split["learner_mesh"] and p["rollout_devices"] == 2
    assert p["rollout_mesh"] == split["rollout_mesh"]
    assert p["transfer_bytes_per_version"] == hand_count_bytes()
    assert p["peak_gib"] > 0 and p["compile_s"] > 0 and p["sample_peak_gib"] > 0 and p["sample_compile_s"] > 0
    assert p["fits"] and p["sample_fits"]
    assert p["sample_params_gib"] * 2 ** 30 == pytest.approx(hand_count_bytes() / 2, rel=1e-9)


@pytest.mark.parametrize("over,match", [
    ({"mesh.rollout": 8}, r"mesh.rollout=8 leaves no learner devices of the 8"),
    ({"mesh.rollout": 3, "mesh.rollout_tensor": 2}, r"mesh.rollout=3 does not divide into mesh.rollout_tensor=2"),
    ({"mesh.rollout": 4, "mesh.rollout_expert": 3}, r"does not divide into .* x mesh.rollout_expert=3"),
    ({"mesh.rollout_tensor": 2}, r"set mesh.rollout \(its devices\) too"),
    ({"mesh.rollout": 2, "mesh.fsdp": 4}, r"does not fit 6 device\(s\) \(the learner's, besides mesh.rollout=2\)"),
    ({"mesh.rollout": -1}, r"mesh.rollout=-1 is out of range"),
])
def test_bad_rollout_meshes_are_one_line_config_errors(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_run_plan(tiny_config(tmp_path, **over), num_devices=8)
    assert "\n" not in str(e.value)


def test_rollout_submesh_shape_in_the_run_plan(tmp_path):
    plan = make_run_plan(tiny_config(tmp_path, **{"mesh.rollout": 4, "mesh.rollout_tensor": 2}), num_devices=8)
    assert plan.rollout_mesh_shape == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    assert plan.mesh_shape == {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1} and plan.batch_shards == 4
    assert make_run_plan(tiny_config(tmp_path), num_devices=4).rollout_mesh_shape is None


def test_transfer_bytes_count_only_devices_outside_the_source():
    """One device here: the shards written onto it count unless it is a source device; a PRNG key counts 8 bytes."""
    mesh = mesh_lib.make_mesh({"fsdp": 1}, jax.devices()[:1])
    tree = {"w": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.int8), "key": jax.random.key(0)}
    shardings = mesh_lib.state_shardings(tree, mesh)
    assert reshard.transfer_bytes(tree, shardings, []) == 3 * 5 * 4 + 7 + 8
    assert reshard.transfer_bytes(tree, shardings, jax.devices()[:1]) == 0
    with pytest.raises(ValueError, match="3 arrays but 2 shardings"):
        reshard.transfer_bytes(tree, {"w": shardings["w"], "b": shardings["b"]}, [])
