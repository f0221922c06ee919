"""Tests for posttrain.learn.optim against formulas written here in NumPy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.learn import optim
def np_lr(step, lr, warmup, total, kind, m):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    f = {"cosine": m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - (1 - m) * p,
         "constant": 1.0}[kind]
    return lr * f


@pytest.mark.parametrize("kind", sorted(optim.SCHEDULES))
def test_schedule_matches_formula(kind):
    sched = optim.make_schedule(1e-3, warmup_steps=10, total_steps=110, schedule=kind, min_lr_ratio=0.1)
    steps = [0, 4, 9, 10, 35, 60, 109, 110, 500]
    got = np.asarray(jax.jit(jax.vmap(sched))(jnp.array(steps)))
    np.testing.assert_allclose(got, [np_lr(s, 1e-3, 10, 110, kind, 0.1) for s in steps], rtol=1e-6)
    assert got[0] > 0 and got[3] == pytest.approx(1e-3)
    if kind != "constant":
        assert got[-1] == pytest.approx(1e-4)


def test_schedule_without_warmup_starts_at_peak():
    sched = optim.make_schedule(2.0, total_steps=4, schedule="linear")
    np.testing.assert_allclose([float(sched(s)) for s in range(5)], [2.0, 1.5, 1.0, 0.5, 0.0], atol=1e-7)


def run_steps(opt, params, grads, n):
    state = opt.tx.init(params)
    update = jax.jit(opt.tx.update)
    updates_seen = []
    for _ in range(n):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        updates_seen.append(updates)
    return params, updates_seen


def test_optimizer_applies_the_schedule():
    opt = optim.make_optimizer("sgd", lr=1.0, b1=0.0, warmup_steps=2, total_steps=6, schedule="linear",
                               grad_clip_norm=None)
    _, updates = run_steps(opt, {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}, 6)
    got = [float(u["w"][0]) for u in updates]
    np.testing.assert_allclose(got, [-np_lr(s, 1.0, 2, 6, "linear", 0.0) for s in range(6)], atol=1e-7)


def test_adamw_first_step_matches_reference():
    p = np.array([1.0, -2.0, 3.0], np.float32)
    g = np.array([0.5, -0.1, 0.0], np.float32)
    opt = optim.make_optimizer(lr=0.01, weight_decay=0.1, eps=1e-8, schedule="constant", grad_clip_norm=None)
    new_p, _ = run_steps(opt, {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}, 1)
    # Bias-corrected first step: m_hat = g, v_hat = g^2 -> update = -lr * (g / (|g| + eps) + wd * p).
    want = p - 0.01 * (g / (np.abs(g) + 1e-8) + 0.1 * p)
    np.testing.assert_allclose(np.asarray(new_p["w"]), want, rtol=1e-6)


def test_adam_couples_weight_decay_into_the_gradient():
    p = np.array([1.0, -2.0, 3.0], np.float32)
    g = np.array([0.5, -0.1, -0.2], np.float32)
    opt = optim.make_optimizer("adam", lr=0.01, weight_decay=0.1, schedule="constant", grad_clip_norm=None)
    new_p, _ = run_steps(opt, {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}, 1)
    g2 = g + 0.1 * p  # L2 enters the moments: the first step is -lr * sign(g2)
    np.testing.assert_allclose(np.asarray(new_p["w"]), p - 0.01 * g2 / (np.abs(g2) + 1e-8), rtol=1e-6)


@pytest.mark.parametrize("grad_norm,clip", [(10.0, 1.0), (0.5, 1.0)])
def test_clipping_caps_the_update_norm(grad_norm, clip):
    g = {"a": jnp.array([3.0, 4.0]) / 5 * grad_norm * 0.6, "b": jnp.array([grad_norm * 0.8])}
    assert float(optax.global_norm(g)) == pytest.approx(grad_norm, rel=1e-6)
    opt = optim.make_optimizer("sgd", lr=1.0, b1=0.0, schedule="constant", grad_clip_norm=clip)
    _, (update,) = run_steps(opt, jax.tree.map(jnp.zeros_like, g), g, 1)
    assert float(optax.global_norm(update)) == pytest.approx(min(grad_norm, clip), rel=1e-5)


def test_trainable_mask_freezes_base_params():
    params = {"base": {"kernel": jnp.ones((4, 4))}, "lora": {"a": jnp.ones((4, 2)), "b": jnp.zeros((2, 4))}}
    grads = {"base": {"kernel": jnp.full((4, 4), 100.0)}, "lora": {"a": jnp.full((4, 2), 0.1),
                                                                    "b": jnp.full((2, 4), 0.1)}}
    mask = {"base": {"kernel": False}, "lora": {"a": True, "b": True}}
    opt = optim.make_optimizer("sgd", lr=1.0, b1=0.0, schedule="constant", grad_clip_norm=1.0,
                               trainable_mask=mask)
    new, _ = run_steps(opt, params, grads, 3)
    np.testing.assert_array_equal(np.asarray(new["base"]["kernel"]), np.ones((4, 4)))
    # The frozen 100s do not count toward the clipping norm: lora's norm 0.4 < 1 passes unclipped.
    np.testing.assert_allclose(np.asarray(new["lora"]["a"]), np.full((4, 2), 1 - 3 * 0.1), rtol=1e-6)
    # AdamW keeps moments only for trainable leaves (frozen ones hold no state).
    only_lora = lambda p: {k: jax.tree.map(lambda _: k == "lora", v) for k, v in p.items()}
    adam = optim.make_optimizer(lr=1e-3, schedule="constant", trainable_mask=only_lora)
    state_elems = sum(x.size for x in jax.tree.leaves(adam.tx.init(params)) if jnp.ndim(x) > 0)
    assert state_elems == 2 * (8 + 8)
    new, _ = run_steps(adam, params, grads, 2)
    assert np.asarray(new["base"]["kernel"]).tolist() == np.ones((4, 4)).tolist()
    assert not np.allclose(np.asarray(new["lora"]["b"]), 0.0)


def test_weight_decay_mask_skips_unmasked_leaves():
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    opt = optim.make_optimizer(lr=0.1, weight_decay=0.5, schedule="constant", grad_clip_norm=None,
                               weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    new, _ = run_steps(opt, params, jax.tree.map(jnp.zeros_like, params), 1)
    np.testing.assert_allclose(np.asarray(new["kernel"]), np.full((2, 2), 1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new["bias"]), np.ones(2))


def test_jit_update_and_lr_of_state_count():
    opt = optim.make_optimizer(lr=1e-3, warmup_steps=3, total_steps=10)
    params = {"w": jnp.ones(5)}
    state = opt.tx.init(params)
    step = jax.jit(lambda s, p, g: opt.tx.update(g, s, p))
    updates, state = step(state, params, {"w": jnp.ones(5)})
    assert np.isfinite(np.asarray(updates["w"])).all() and float(opt.lr_schedule(0)) == pytest.approx(1e-3 / 3)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; valid: \['adam', 'adamw', 'sgd'\]"):
        optim.make_optimizer("lion", lr=1e-3, schedule="constant")
    with pytest.raises(ValueError, match=r"unknown schedule 'step'; valid: \['constant', 'cosine', 'linear'\]"):
        optim.make_optimizer(lr=1e-3, schedule="step")
    with pytest.raises(ValueError, match="needs total_steps > warmup_steps"):
        optim.make_optimizer(lr=1e-3, warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        optim.make_schedule(1e-3, total_steps=10, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="grad_clip_norm"):
        optim.make_optimizer(lr=1e-3, schedule="constant", grad_clip_norm=0.0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        optim.make_optimizer(lr=0.0, schedule="constant")


def test_the_schedule_spans_every_update_of_the_run():
    """With several optimizer updates per train step (rl.ppo_epochs x rl.minibatches) a decaying schedule reaches its
    end at the run's last update, not after the first 1/U of the run (its clock is the update counter)."""
    import pathlib

    from posttrain.learn.learner import LearnerSettings
    from posttrain.learn.optim import OptimConfig

    cfg = OptimConfig(lr=1.0, schedule="linear", min_lr_ratio=0.0)
    one = LearnerSettings(workdir=pathlib.Path("x"), optimizer=cfg, total_steps=4).build_optimizer().lr_schedule
    four = LearnerSettings(workdir=pathlib.Path("x"), optimizer=cfg, total_steps=4,
                           updates_per_step=4).build_optimizer().lr_schedule
    assert float(one(2)) == pytest.approx(0.5) and float(one(4)) == pytest.approx(0.0)
    assert float(four(8)) == pytest.approx(0.5) and float(four(15)) == pytest.approx(1 / 16)  # halfway, then the end
