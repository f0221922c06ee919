"""Tests for posttrain.algos.grpo.losses against NumPy references written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algos.grpo import losses
F32 = np.float32


# ----- NumPy references -----
def np_ppo_token_loss(ratio, adv, eps_low, eps_high, dual_c=None):
    loss = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if dual_c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual_c * adv), loss)
    return loss


def np_aggregate(x, mask, mode, norm=None):
    x = np.where(mask, x, 0.0)
    lens = mask.sum(-1)
    n_seqs = max((lens > 0).sum(), 1)
    if mode == "token_mean":
        return x.sum() / max(mask.sum(), 1)
    if mode == "seq_mean_token_mean":
        return (x.sum(-1) / np.maximum(lens, 1)).sum() / n_seqs
    return x.sum() / norm / n_seqs


def random_batch(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    logp = -rng.random((b, t)).astype(F32) * 2
    sample = (logp + rng.normal(0, 0.3, (b, t))).astype(F32)
    ref = (logp + rng.normal(0, 0.3, (b, t))).astype(F32)
    adv = rng.normal(size=b).astype(F32)
    mask = np.zeros((b, t), bool)
    for i, n in enumerate(rng.integers(1, t + 1, b)):
        mask[i, :n] = True
    return logp, sample, ref, adv, mask


# ----- surrogates -----
@pytest.mark.parametrize("dual_c", [None, 3.0])
def test_ppo_matches_reference(dual_c):
    logp, sample, _, adv, mask = random_batch(1, b=6, t=8)
    sample = logp + np.random.default_rng(2).normal(0, 0.8, logp.shape).astype(F32)  # many clipped tokens
    adv_bt = np.broadcast_to(adv[:, None], logp.shape)
    ratio = np.exp(logp.astype(np.float64) - sample)
    out = losses.ppo(logp, sample, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=dual_c)
    want = np.where(mask, np_ppo_token_loss(ratio, adv_bt, 0.2, 0.28, dual_c), 0.0)
    np.testing.assert_allclose(np.asarray(out.loss_BxT), want, rtol=1e-5, atol=1e-6)
    low, high = mask & (ratio < 0.8) & (adv_bt < 0), mask & (ratio > 1.28) & (adv_bt > 0)
    assert low.any() and high.any()
    np.testing.assert_array_equal(np.asarray(out.clipped_low_BxT), low)
    np.testing.assert_array_equal(np.asarray(out.clipped_high_BxT), high)


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^3 ~ 20 with A = -1: plain PPO loss 20, dual clip c=3 caps it at 3 (zero gradient).
    args = (jnp.array([[0.0]]), jnp.array([[-3.0]]), jnp.array([-1.0]), jnp.array([[1]]))
    plain = losses.ppo(*args, eps_low=0.2, eps_high=0.2)
    dual = losses.ppo(*args, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    np.testing.assert_allclose(float(plain.loss_BxT[0, 0]), math.exp(3), rtol=1e-6)
    assert float(dual.loss_BxT[0, 0]) == 3.0
    g = jax.grad(lambda lp: losses.ppo(lp, *args[1:], eps_low=0.2, eps_high=0.2, dual_clip_c=3.0).loss_BxT.sum())
    assert float(g(args[0])[0, 0]) == 0.0


def test_gspo_value_and_gradient_match_sequence_level_reference():
    logp, old, _, adv, mask = random_batch(3, b=5, t=7)
    old = logp + np.random.default_rng(4).normal(0, 0.05, logp.shape).astype(F32)
    eps_lo, eps_hi = 0.01, 0.02
    den = losses.loss_denominators(mask)
    lens = mask.sum(-1)
    s = np.exp((np.where(mask, logp.astype(np.float64) - old, 0)).sum(-1) / lens)
    seq_loss = np_ppo_token_loss(s, adv, eps_lo, eps_hi)
    unclipped = (s * adv <= np.clip(s, 1 - eps_lo, 1 + eps_hi) * adv)
    assert unclipped.any() and not unclipped.all()
    want_grad = np.where(mask, (-adv * s * unclipped / lens / len(lens))[:, None], 0.0)

    def f(lp):
        out = losses.gspo(lp, old, adv, mask, eps_low=eps_lo, eps_high=eps_hi)
        return losses.seq_mean_token_mean(out.loss_BxT, mask, den)

    value, grad = jax.jit(jax.value_and_grad(f))(jnp.asarray(logp))
    np.testing.assert_allclose(float(value), seq_loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)


# ----- KL -----
def test_kl_estimator_values_from_the_brief():
    logp, ref = jnp.array([-1.0]), jnp.array([-1.5])
    np.testing.assert_allclose(float(losses.kl_k1(logp, ref)[0]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(losses.kl_k2(logp, ref)[0]), 0.125, rtol=1e-6)
    np.testing.assert_allclose(float(losses.kl_k3(logp, ref)[0]), math.exp(-0.5) - 1 + 0.5, rtol=1e-6)


def test_kl_estimators_reference_nonnegativity_and_gradient_side():
    rng = np.random.default_rng(5)
    logp, ref = -rng.random(1000).astype(F32) * 5, -rng.random(1000).astype(F32) * 5
    d = logp.astype(np.float64) - ref
    refs = {"k1": d, "k2": 0.5 * d**2, "k3": np.exp(-d) - 1 + d}
    assert set(losses.KL_ESTIMATORS) == set(refs)
    for name, fn in losses.KL_ESTIMATORS.items():
        np.testing.assert_allclose(np.asarray(fn(logp, ref)), refs[name], rtol=1e-4, atol=1e-6)
        g_ref = jax.grad(lambda r: fn(jnp.asarray(logp), r).sum())(jnp.asarray(ref))
        assert not np.asarray(g_ref).any(), name  # stop_gradient on the reference
    assert (np.asarray(losses.kl_k3(logp, ref)) >= 0).all()
    g = jax.grad(lambda lp: losses.kl_k3(lp, ref).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), 1 - np.exp(-d), rtol=1e-4, atol=1e-6)


# ----- aggregation -----
@pytest.mark.parametrize("mode", sorted(losses.AGGREGATIONS))
def test_aggregations_match_reference(mode):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(5, 9)).astype(F32)
    mask = rng.random((5, 9)) > 0.4
    mask[2] = False
    got = losses.AGGREGATIONS[mode](x, mask, losses.loss_denominators(mask), 16.0)
    np.testing.assert_allclose(float(got), np_aggregate(x, mask, mode, 16.0), rtol=1e-6)


def test_token_mean_is_global_across_microbatches():
    mask_a, mask_b = np.ones((1, 100), bool), np.ones((1, 900), bool)
    den = losses.LossDenominators(jnp.float32(1000.0), jnp.float32(2.0))  # the full batch's
    total = losses.token_mean(np.full((1, 100), 0.5, F32), mask_a, den) + losses.token_mean(
        np.full((1, 900), 0.3, F32), mask_b, den)
    np.testing.assert_allclose(float(total), 0.32, rtol=1e-6)


def test_masked_long_sample_does_not_dilute_short_one():
    x = np.ones((2, 1000), F32)
    mask = np.zeros((2, 1000), bool)
    mask[0, :10] = True  # 10 policy tokens; row 1 is a truncated sample fully masked out
    den = losses.loss_denominators(mask)
    assert float(den.num_tokens) == 10 and float(den.num_seqs) == 1
    for mode in losses.AGGREGATIONS:
        want = 10 / 64.0 if mode == "seq_mean_token_sum_norm" else 1.0
        np.testing.assert_allclose(float(losses.AGGREGATIONS[mode](x, mask, den, 64.0)), want, rtol=1e-6)


def test_sum_norm_uses_the_constant_not_the_padded_width():
    x, mask = np.ones((1, 8), F32), np.r_[[True] * 4 + [False] * 4][None]
    wide_x, wide_mask = np.pad(x, ((0, 0), (0, 24))), np.pad(mask, ((0, 0), (0, 24)))
    for xx, mm in ((x, mask), (wide_x, wide_mask)):
        np.testing.assert_allclose(float(losses.seq_mean_token_sum_norm(xx, mm, losses.loss_denominators(mm), 16.0)), 0.25)


# ----- composed loss -----
def np_policy_loss(logp, sample, ref, adv, mask, cfg, old=None):
    """NumPy reference of policy_loss for the ppo loss; the ratio's denominator is the trainer's old logp (given)
    or its own logp; the sampler's logp enters only the TIS weight."""
    old = logp if old is None else old
    ratio = np.exp(logp.astype(np.float64) - old)
    tok = np_ppo_token_loss(ratio, np.broadcast_to(adv[:, None], logp.shape), cfg.eps_low, cfg.eps_high,
                            cfg.dual_clip_c)
    if cfg.tis_cap is not None:
        tok = tok * np.minimum(np.exp(old.astype(np.float64) - sample), cfg.tis_cap)
    d = logp.astype(np.float64) - ref
    kl = np.exp(-d) - 1 + d
    agg = lambda x: np_aggregate(x, mask, cfg.aggregation, cfg.norm_constant)
    return agg(tok) + cfg.beta * agg(kl), np.where(mask, kl, 0).sum() / mask.sum()


@pytest.mark.parametrize("given_old", [False, True])
@pytest.mark.parametrize("tis_cap", [None, 1.1])
@pytest.mark.parametrize("mode", sorted(losses.AGGREGATIONS))
def test_policy_loss_matches_reference(mode, tis_cap, given_old):
    logp, sample, ref, adv, mask = random_batch(8, b=5, t=6)
    old = (logp + np.random.default_rng(1).normal(0, 0.2, logp.shape)).astype(F32) if given_old else None
    cfg = losses.LossConfig(aggregation=mode, norm_constant=6.0, beta=0.05, eps_high=0.28, dual_clip_c=3.0,
                       tis_cap=tis_cap)
    loss, metrics = jax.jit(losses.policy_loss, static_argnums=5)(
        logp, sample, adv, mask, losses.loss_denominators(mask), cfg, logp_ref_BxT=ref, logp_old_BxT=old)
    want_loss, want_kl = np_policy_loss(logp, sample, ref, adv, mask, cfg, old)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["policy/loss"]), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["policy/kl_ref"]), want_kl, rtol=1e-5)
    old = logp if old is None else old
    np.testing.assert_allclose(float(metrics["policy/ppo_kl"]), (old - logp)[mask].mean(), rtol=1e-5, atol=1e-7)
    ratio = np.exp(logp.astype(np.float64) - old)[mask]
    for name, want in (("mean", ratio.mean()), ("min", ratio.min()), ("max", ratio.max())):
        np.testing.assert_allclose(float(metrics[f"policy/is_ratio_{name}"]), want, rtol=1e-5)
    if tis_cap:
        w = np.minimum(np.exp(old - sample), tis_cap)[mask].mean()
        np.testing.assert_allclose(float(metrics["policy/tis_weight"]), w, rtol=1e-5)


def test_first_step_ratio_is_one_whatever_the_sampler_said():
    logp, sample, _, adv, mask = random_batch(9)  # sampler logprobs differ from the trainer's by ~0.3
    loss, metrics = losses.policy_loss(logp, sample, adv, mask, losses.loss_denominators(mask), losses.LossConfig(eps_low=3e-4,
                                                                                                   eps_high=4e-4))
    want = -np.where(mask, adv[:, None], 0).sum() / mask.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["policy/ppo_kl"]) == 0.0
    assert float(metrics["policy/clipfrac_low"]) == 0.0 and float(metrics["policy/clipfrac_high"]) == 0.0
    assert float(metrics["policy/is_ratio_min"]) == 1.0 == float(metrics["policy/is_ratio_max"])


def test_explicit_trainer_old_logp_is_the_ratio_denominator():
    logp, sample, _, adv, mask = random_batch(10)
    den = losses.loss_denominators(mask)
    old = (logp - 0.1).astype(F32)
    a, _ = losses.policy_loss(logp, sample, adv, mask, den, losses.LossConfig(), logp_old_BxT=old)
    b, _ = losses.policy_loss(logp, logp + 1.0, adv, mask, den, losses.LossConfig(), logp_old_BxT=old)
    c, _ = losses.policy_loss(logp, sample, adv, mask, den, losses.LossConfig())
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)  # the sampler's logp does not enter the ratio
    assert abs(float(a) - float(c)) > 1e-3  # the trainer's old logp does


@pytest.mark.parametrize("loss_name", sorted(losses.POLICY_LOSSES))
@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_nan_at_masked_positions_cannot_leak(loss_name, tis_cap):
    cfg = losses.LossConfig(policy_loss=loss_name, beta=0.1, tis_cap=tis_cap)
    mask = jnp.array([[1, 0]])
    nan_old = jnp.array([[0.0, jnp.nan]])

    def f(lp):
        return losses.policy_loss(lp, nan_old, jnp.array([1.0]), mask, losses.loss_denominators(mask), cfg,
                             logp_ref_BxT=jnp.array([[0.0, jnp.inf]]), entropy_BxT=nan_old)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.array([[0.0, 0.0]]))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    assert all(np.isfinite(float(v)) for v in metrics.values())
    np.testing.assert_allclose(float(loss), -1.0, rtol=1e-6)
    (loss, _), grad = jax.value_and_grad(f, has_aux=True)(jnp.array([[0.0, jnp.nan]]))  # NaN in the trainer's too
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all() and float(grad[0, 1]) == 0.0


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_term_gradient_is_zero_at_reference_and_nonzero_after(estimator):
    logp, _, _, _, mask = random_batch(11)
    zero_adv = np.zeros(logp.shape[0], F32)  # isolates the KL term
    cfg = losses.LossConfig(beta=0.5, kl_estimator=estimator)
    den = losses.loss_denominators(mask)
    f = lambda lp, ref: losses.policy_loss(lp, lp, zero_adv, mask, den, cfg, logp_ref_BxT=ref)
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp), jnp.asarray(logp))
    assert float(loss) == 0.0 and float(metrics["policy/kl_ref"]) == 0.0 and not np.asarray(g).any()
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp) + 0.1, jnp.asarray(logp))
    assert float(loss) > 0 and float(metrics["policy/kl_ref"]) > 0
    assert np.all(np.asarray(g)[mask] > 0) and not np.asarray(g)[~mask].any()


@pytest.mark.parametrize("loss_name,mode", [("ppo", "token_mean"), ("gspo", "seq_mean_token_mean"),
                                            ("ppo", "seq_mean_token_sum_norm")])
def test_policy_loss_and_grad_do_not_depend_on_microbatching(loss_name, mode):
    logp, sample, ref, adv, mask = random_batch(7, b=6, t=5)
    ent = np.abs(ref)
    den = losses.loss_denominators(mask)
    cfg = losses.LossConfig(policy_loss=loss_name, aggregation=mode, norm_constant=5.0, beta=0.1,
                       eps_high=0.28, dual_clip_c=3.0, tis_cap=2.0)

    old = (logp + np.random.default_rng(2).normal(0, 0.3, logp.shape)).astype(F32)  # ratios around 1, some clipped

    @jax.jit
    def fn(lp, s, r, a, m, e, o):
        return jax.value_and_grad(losses.policy_loss, has_aux=True)(lp, s, a, m, den, cfg, logp_ref_BxT=r,
                                                               entropy_BxT=e, logp_old_BxT=o)

    arrays = [jnp.asarray(x) for x in (logp, sample, ref, adv, mask, ent, old)]
    (loss, metrics), grad = fn(*arrays)
    parts = [fn(*[a[lo:hi] for a in arrays]) for lo, hi in ((0, 3), (3, 6))]  # unequal token counts
    np.testing.assert_allclose(sum(float(p[0][0]) for p in parts), float(loss), rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), np.asarray(grad), rtol=1e-5, atol=1e-7)
    assert set(metrics) == {"policy/loss", "policy/clipfrac_low", "policy/clipfrac_high", "policy/ppo_kl",
                            "policy/kl_ref", "policy/entropy", "policy/tis_weight", "policy/is_ratio_mean",
                            "policy/is_ratio_min", "policy/is_ratio_max"}
    assert float(metrics["policy/is_ratio_max"]) > 1.2 and float(metrics["policy/is_ratio_min"]) < 0.8
    for key in metrics:
        combine = min if key in losses.MIN_METRICS else max if key in losses.MAX_METRICS else sum
        total = combine(float(p[0][1][key]) for p in parts)
        np.testing.assert_allclose(total, float(metrics[key]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["policy/entropy"]), ent[mask].mean(), rtol=1e-5)


def pack_pairs(x_BxT, prompt_value, prompt_len=2):
    """Packs rows (2r, 2r+1) into row r behind a prompt: [prompt | seq 2r | seq 2r+1]."""
    b = x_BxT.shape[0]
    prompt = np.full((b // 2, prompt_len), prompt_value, x_BxT.dtype)
    return np.concatenate([prompt, x_BxT[0::2], x_BxT[1::2]], axis=1)


@pytest.mark.parametrize("loss_name,mode", [("gspo", "seq_mean_token_mean"), ("ppo", "seq_mean_token_mean"),
                                            ("gspo", "seq_mean_token_sum_norm")])
def test_packed_rows_give_the_same_loss_and_gradient(loss_name, mode):
    logp, sample, ref, adv, mask = random_batch(13, b=4, t=6)
    t = logp.shape[1]
    cfg = losses.LossConfig(policy_loss=loss_name, aggregation=mode, norm_constant=6.0, beta=0.1, eps_high=0.28)
    seq_ids = pack_pairs(np.tile([2] * t, (4, 1)) + np.array([[0], [t]] * 2), 0)  # id = first position
    packed = [pack_pairs(x, np.nan) for x in (logp, sample, ref)]
    packed_adv = pack_pairs(np.broadcast_to(adv[:, None], logp.shape).astype(F32), 0.0)
    packed_mask = pack_pairs(mask, False)
    loss_fn = jax.jit(jax.value_and_grad(losses.policy_loss, has_aux=True), static_argnums=5)
    (loss, metrics), grad = loss_fn(logp, sample, adv, mask, losses.loss_denominators(mask), cfg, logp_ref_BxT=ref)
    den = losses.loss_denominators(packed_mask, seq_ids)
    assert float(den.num_seqs) == 4 and float(den.num_tokens) == mask.sum()
    (p_loss, p_metrics), p_grad = loss_fn(packed[0], packed[1], packed_adv, packed_mask, den, cfg,
                                          logp_ref_BxT=packed[2], seq_ids_BxT=seq_ids)
    np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-5)
    for key in metrics:
        np.testing.assert_allclose(float(p_metrics[key]), float(metrics[key]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(p_grad), pack_pairs(np.asarray(grad), 0.0), rtol=1e-5, atol=1e-8)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"unknown policy_loss 'grpo'; valid: \['gspo', 'ppo'\]"):
        losses.LossConfig(policy_loss="grpo")
    with pytest.raises(ValueError, match=r"unknown kl_estimator 'k4'; valid: \['k1', 'k2', 'k3'\]"):
        losses.LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; valid"):
        losses.LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="norm_constant"):
        losses.LossConfig(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="dual_clip_c"):
        losses.LossConfig(dual_clip_c=0.5)
    logp, sample, ref, adv, mask = random_batch(12)
    den = losses.loss_denominators(mask)
    with pytest.raises(ValueError, match="needs logp_ref_BxT"):
        losses.policy_loss(logp, sample, adv, mask, den, losses.LossConfig(beta=0.1))
    with pytest.raises(ValueError, match=r"shape mismatch.*logp_sample_BxT"):
        losses.policy_loss(logp, sample[:, :3], adv, mask, den, losses.LossConfig())
    with pytest.raises(ValueError, match=r"advantages \(2,\) \(want \[B\] or \[B, T\]\)"):
        losses.policy_loss(logp, sample, adv[:2], mask, den, losses.LossConfig())
    with pytest.raises(TypeError, match="LossConfig"):
        losses.policy_loss(logp, sample, adv, mask, den, {"beta": 0.0})
    with pytest.raises(ValueError, match="shape mismatch"):
        losses.chunked_token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="temperature"):
        losses.token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), 0.0)
