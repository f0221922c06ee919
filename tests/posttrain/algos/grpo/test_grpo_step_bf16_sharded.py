"""The jitted GRPO step's exactness, split from test_grpo_step.py (whose file alone bounded the suite's wall under
`--dist loadfile`): one device equals eight fake devices (invariant 3), and in bfloat16 the step-0 importance ratio
is exactly 1 and nothing is clipped under GSPO's 3e-4 / 4e-4 clip range (invariant 1: the trainer's logprobs are
the sampler's to the bit); PPO epochs over minibatches see ratio 1 only on their first update."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algos.grpo import losses
from posttrain.algos.grpo import step
from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn import optim
from posttrain.learn.state import create_train_state


SHARDED = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
    import jax, jax.numpy as jnp, numpy as np
    from test_grpo_step import make_state, random_batch
    from posttrain.infra import mesh as mesh_lib
    from posttrain.algos.grpo import step
    from posttrain.learn.learner import batch_shardings
    out = {}
    for preset in ("tiny-dense", "tiny-moe"):
        batch = random_batch(R=8, S=2)
        graphdef, state, opts, _ = make_state(preset, beta=0.05, random_weights=True)  # no eager init
        opts = opts._replace(moe_aux_coef=0.0, moe_z_coef=0.0)
        g1, m1 = jax.jit(lambda s, b: step.accumulate_gradients(graphdef, s, b, opts))(state, batch)
        mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "expert": 2} if "moe" in preset else {"data": 2, "fsdp": 4})
        with jax.set_mesh(mesh):
            shard = lambda x: jax.device_put(x, mesh_lib.state_shardings(x, mesh))
            state = state.replace(params=shard(state.params), ref_params=shard(state.ref_params))
            batch = jax.device_put(batch, batch_shardings(mesh, batch))
            g8, m8 = jax.jit(lambda s, b: step.accumulate_gradients(graphdef, s, b, opts))(state, batch)
        assert len(jax.tree.leaves(state.params)[0].sharding.device_set) == 8
        diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)))
        out[preset] = {"grad_diff": diff, "loss_diff": abs(float(m1["policy/loss"]) - float(m8["policy/loss"]))}
    print(json.dumps(out))
""")


def test_one_device_equals_eight_fake_devices(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, str(script), __file__], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for preset, d in out.items():
        assert d["grad_diff"] <= 1e-5 and d["loss_diff"] <= 1e-6, (preset, d)


def _bf16_state(loss_name, preset="tiny-dense", param_dtype="float32", **opts_kw):
    from helpers import random_model  # random weights drawn on the host: no init compile

    _, graphdef, model_state = random_model(preset, dtype="bfloat16", param_dtype=param_dtype)
    opts = step.StepOptions(loss=losses.LossConfig(policy_loss=loss_name, eps_low=3e-4, eps_high=4e-4,
                                                 aggregation="seq_mean_token_mean"),
                          temperature=1.0, **opts_kw)
    opt = optim.make_optimizer("adamw", lr=1e-3, schedule="constant")
    graphdef, state = create_train_state(graphdef, model_state, opt.tx, jax.random.key(0), lora_rank=opts.lora_rank)
    return graphdef, state, opts, opt


# slow (one train-step compile each; every part covered by a default case): ppo unpacked = ppo's loss (ppo packed)
# on the unpacked layout's logprobs (gspo unpacked); gspo packed on tiny-dense = the last two cases' path
@pytest.mark.parametrize("loss_name,packed,variant", [
    ("ppo", True, {}), pytest.param("ppo", False, {}, marks=pytest.mark.slow),
    pytest.param("gspo", True, {}, marks=pytest.mark.slow), ("gspo", False, {}),
    ("gspo", True, {"preset": "tiny-deepseek", "bias_update_rate": 0.05}),  # MLA + routed experts in bf16
    ("gspo", True, {"param_dtype": "bfloat16", "num_microbatches": 2}),  # bf16 master weights, accumulation
])
def test_bf16_step_zero_ratio_is_exactly_one_and_nothing_is_clipped(loss_name, packed, variant):
    """GSPO's clip range is 3e-4 / 4e-4: any trainer-vs-sampler rounding in the ratio would clip most tokens.
    tiny-deepseek also checks DeepSeek's aux-loss-free balancing in the same step (one compile for both): every
    expert's selection bias moves by +-bias_update_rate or not at all, and some move."""
    from posttrain.rollout.batching import random_batch as layout_batch

    graphdef, state, opts, opt = _bf16_state(loss_name, **variant)
    batch = jax.tree.map(jnp.asarray, layout_batch(0, advantage_fn("grpo"), prompts=2, group_size=4, prompt_len=16, completion_len=8,
                                                   vocab_size=128, packed=packed))
    assert batch.samples_per_row == (4 if packed else 1)
    new_state, m = jax.jit(step.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts))(state, batch)
    assert float(m["policy/is_ratio_min"]) == 1.0 == float(m["policy/is_ratio_max"])
    assert float(m["policy/clipfrac_low"]) == 0.0 == float(m["policy/clipfrac_high"])
    assert float(m["policy/ppo_kl"]) == 0.0
    assert float(m["rollout/logp_diff_mean"]) > 0.1  # the random "sampler" logprobs are far from the trainer's
    if opts.bias_update_rate:
        before, after = (_score_bias(s) for s in (state, new_state))
        assert float(m["moe/expert_load_max"]) >= float(m["moe/expert_load_min"])
        steps = np.round((after - before) / opts.bias_update_rate, 5)
        assert np.all(np.isin(steps, [-1.0, 0.0, 1.0])) and np.abs(steps).max() > 0, steps


def _score_bias(state) -> np.ndarray:
    """The first MoE layer's selection bias [E] (float32, a frozen variable the step updates by itself)."""
    return [np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state.frozen["other"]) if p[-1] == "score_bias"][0]


def test_ppo_epochs_first_update_ratio_is_one_later_updates_differ():
    from posttrain.rollout.batching import random_batch as layout_batch

    graphdef, state, opts, opt = _bf16_state("ppo", ppo_epochs=2, minibatches=2)
    opts = opts._replace(loss=losses.LossConfig(eps_low=0.2, eps_high=0.2))
    batch = jax.tree.map(jnp.asarray, layout_batch(1, advantage_fn("grpo"), prompts=4, group_size=2, prompt_len=16, completion_len=8,
                                                   vocab_size=128))
    new_state, per_update = jax.jit(lambda s, b: step.ppo_updates(graphdef, s, b, opt.tx, opt.lr_schedule, opts))(
        state, batch)
    lo, hi = np.asarray(per_update["policy/is_ratio_min"]), np.asarray(per_update["policy/is_ratio_max"])
    assert lo.shape == (4,) and int(new_state.step) == 4
    assert lo[0] == 1.0 == hi[0]  # first update: the behaviour policy is the current one, exactly
    assert np.all((lo[1:] < 1.0) | (hi[1:] > 1.0))  # later updates see moved weights
    assert np.all(np.asarray(per_update["policy/ppo_kl"])[1:] != 0.0)
    # the whole step reports the same updates, reduced over them
    _, m = jax.jit(step.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts))(state, batch)
    np.testing.assert_allclose(float(m["policy/is_ratio_max"]), hi.max(), rtol=1e-6)
    np.testing.assert_allclose(float(m["policy/loss"]), np.asarray(per_update["policy/loss"]).mean(), rtol=1e-5)
