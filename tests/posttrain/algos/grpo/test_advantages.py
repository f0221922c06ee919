"""Tests for posttrain.algos.grpo.advantages against NumPy references written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algos.grpo import advantages  # ----- NumPy references (one group at a time, valid samples only) -----
def ref_grpo(r, eps=1e-6):
    r = np.asarray(r, np.float64)
    if len(r) < 2 or np.all(r == r[0]):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + eps)


def ref_dr_grpo(r):
    r = np.asarray(r, np.float64)
    if len(r) < 2 or np.all(r == r[0]):
        return np.zeros_like(r)
    return r - r.mean()


def ref_rloo(r):
    r = np.asarray(r, np.float64)
    n = len(r)
    if n < 2 or np.all(r == r[0]):
        return np.zeros_like(r)
    return np.array([r[i] - np.delete(r, i).mean() for i in range(n)])


REFS = {"grpo": ref_grpo, "dr_grpo": ref_dr_grpo, "rloo": ref_rloo}


def ref_batch(name, rewards_PxG, valid_PxG):
    out = np.zeros(rewards_PxG.shape)
    for p in range(rewards_PxG.shape[0]):
        v = valid_PxG[p]
        out[p, v] = REFS[name](rewards_PxG[p, v])
    return out


def test_registry_matches_references():
    assert set(advantages.ADVANTAGES) == set(REFS)


@pytest.mark.parametrize("name", sorted(REFS))
def test_random_groups_match_reference(name):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(6, 8)).astype(np.float32)
    rewards[1] = 0.7  # all equal
    rewards[2, :4] = 1.0  # half equal
    valid = rng.random((6, 8)) > 0.25
    valid[3] = False  # no valid sample at all
    valid[4] = False
    valid[4, 2] = True  # a single valid sample
    rewards_nan = np.where(valid, rewards, np.nan)  # NaN at invalid samples must not leak
    out = jax.jit(advantages.ADVANTAGES[name])(rewards_nan, valid)
    want = ref_batch(name, rewards, valid)
    np.testing.assert_allclose(np.asarray(out.advantages), want, rtol=1e-5, atol=1e-5)
    assert out.advantages.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out.zero_std_P), [False, True, False, True, True, False])


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0, 1.0], [0.35] * 8, [0.1] * 3, [0.0] * 5])
def test_all_equal_group_is_exactly_zero(name, rewards):
    out = jax.jit(advantages.ADVANTAGES[name])(jnp.asarray([rewards], jnp.float32))
    assert np.asarray(out.advantages).tolist() == [[0.0] * len(rewards)]  # exact, not allclose
    assert bool(out.zero_std_P[0])


@pytest.mark.parametrize("name", sorted(REFS))
def test_equal_groups_where_float32_centring_is_inexact_give_exact_zero(name):
    """Many all-equal groups of random values and sizes, including ones where r - mean(r) in float32 is not 0:
    the library's advantages are exactly 0 on every one of them (and flagged zero-std)."""
    rng = np.random.default_rng(0)
    values = rng.random(64).astype(np.float32)
    inexact = 0
    for G in (3, 5, 7, 8, 16):
        rewards = np.repeat(values[:, None], G, axis=1)
        inexact += int((np.asarray(rewards - jnp.mean(jnp.asarray(rewards), 1, keepdims=True)) != 0).any(1).sum())
        out = advantages.ADVANTAGES[name](jnp.asarray(rewards))
        assert (np.asarray(out.advantages) == 0.0).all(), (G, np.abs(np.asarray(out.advantages)).max())
        assert np.asarray(out.zero_std_P).all()
    assert inexact >= 10, f"only {inexact} groups where naive float32 centring is inexact: the test would prove little"


@pytest.mark.parametrize("name", sorted(REFS))
def test_nearly_equal_group_is_finite_and_sensible(name):
    rewards = np.array([[0.35] * 7 + [0.0]], np.float32)
    out = advantages.ADVANTAGES[name](rewards)
    a = np.asarray(out.advantages)[0]
    assert np.isfinite(a).all() and not bool(out.zero_std_P[0])
    assert (a[:7] > 0).all() and a[7] < 0 and np.allclose(a[:7], a[0])
    np.testing.assert_allclose(a, REFS[name](rewards[0]), rtol=1e-5)
    if name == "grpo":  # std-normalised: bounded by sqrt(G - 1) * (G - 1) / G for one outlier
        assert abs(a[7]) < 3.0


def test_invalid_samples_are_excluded_and_zero():
    rewards = np.array([[1.0, 0.0, 0.0, 123.0]], np.float32)
    valid = np.array([[True, True, True, False]])
    out = advantages.dr_grpo(rewards, valid)
    np.testing.assert_allclose(np.asarray(out.advantages), [[2 / 3, -1 / 3, -1 / 3, 0.0]], rtol=1e-6)
    # Only one valid sample left in the group -> no signal.
    out = advantages.grpo(rewards, np.array([[True, False, False, False]]))
    assert np.asarray(out.advantages).tolist() == [[0.0] * 4] and bool(out.zero_std_P[0])


def test_rloo_equals_scaled_centring():
    r = np.array([[1.0, 0.0, 0.5, 0.25]], np.float32)
    got = np.asarray(advantages.rloo(r).advantages)
    np.testing.assert_allclose(got, 4 / 3 * (r - r.mean()), rtol=1e-6)


def test_grpo_std_eps_is_used():
    r = np.array([[1.0, 0.0]], np.float32)
    a = np.asarray(advantages.grpo(r, std_eps=1.0).advantages)
    np.testing.assert_allclose(a, ref_grpo(r[0], eps=1.0)[None], rtol=1e-6)


def test_compute_advantages_flat_layout():
    rewards = np.array([1, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1, 1, 0, 0], np.float32)
    valid = np.ones(12, bool)
    group_ids = np.repeat([7, 3, 9], 4)
    out = advantages.compute_advantages("grpo", rewards, valid, group_size=4, group_id_B=group_ids)
    want = ref_batch("grpo", rewards.reshape(3, 4), valid.reshape(3, 4)).reshape(-1)
    np.testing.assert_allclose(np.asarray(out.advantages), want, rtol=1e-5)
    assert out.advantages.shape == (12,)
    np.testing.assert_array_equal(np.asarray(out.zero_std_P), [False, True, False])
    jitted = jax.jit(lambda r, v: advantages.compute_advantages("rloo", r, v, group_size=4))
    np.testing.assert_allclose(
        np.asarray(jitted(rewards, valid).advantages),
        ref_batch("rloo", rewards.reshape(3, 4), valid.reshape(3, 4)).reshape(-1),
        rtol=1e-5,
    )


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"'ppo'.*dr_grpo.*grpo.*rloo"):
        advantages.compute_advantages("ppo", np.zeros(4), group_size=2)
    with pytest.raises(ValueError, match="divisible by group_size=3"):
        advantages.compute_advantages("grpo", np.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="valid_B shape"):
        advantages.compute_advantages("grpo", np.zeros(4), np.ones(3, bool), group_size=2)
    with pytest.raises(ValueError, match="contiguous groups of 2"):
        advantages.compute_advantages("grpo", np.zeros(4), group_size=2, group_id_B=np.array([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="2-D"):
        advantages.grpo(np.zeros(4))
    with pytest.raises(ValueError, match="valid_PxG shape"):
        advantages.rloo(np.zeros((2, 2)), np.ones((2, 3), bool))
    with pytest.raises(TypeError):
        advantages.compute_advantages("rloo", np.zeros(4), group_size=2, std_eps=1.0)
