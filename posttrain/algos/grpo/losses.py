"""Policy-gradient losses of the GRPO family: clipped surrogates, KL estimators, global aggregation.

Shapes: the legend in `posttrain.types`. Masking and global denominators: docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from posttrain.learn.logprobs import (  # noqa: F401  (re-exported: the token logprob definition lives there)
    LogprobsOut, chunked_token_logprobs, token_entropy, token_logprobs, valid_first_order)

# |log ratio| bound before exp() so a stale or broken token cannot overflow (verl's bound); zero gradient beyond
LOG_RATIO_CLAMP = 20.0
_sg = jax.lax.stop_gradient


class Surrogate(NamedTuple):
    loss_BxT: jax.Array  # float32 per-token loss, 0 at masked positions
    clipped_low_BxT: jax.Array  # bool: ratio < 1 - eps_low with A < 0 (lower clip active)
    clipped_high_BxT: jax.Array  # bool: ratio > 1 + eps_high with A > 0 (upper clip active)


def clipped_surrogate(log_ratio_BxT, advantages_BxT, mask_BxT, *, eps_low: float, eps_high: float,
                      dual_clip_c: float | None = None) -> Surrogate:
    """PPO clipped surrogate as a loss: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(log_ratio).

    Sources: PPO (Schulman et al. 2017, eq. 7); clip-higher (Yu et al. 2025, eq. 10); dual clip (Ye et al. 2020).
    """
    mask = jnp.asarray(mask_BxT).astype(bool)
    log_ratio = jnp.clip(jnp.where(mask, log_ratio_BxT, 0.0), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = jnp.where(mask, advantages_BxT, 0.0).astype(jnp.float32)
    ratio = jnp.exp(log_ratio.astype(jnp.float32))
    loss = jnp.maximum(-ratio * adv, -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if dual_clip_c is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip_c * adv), loss)
    return Surrogate(
        loss_BxT=jnp.where(mask, loss, 0.0),
        clipped_low_BxT=mask & (ratio < 1.0 - eps_low) & (adv < 0),
        clipped_high_BxT=mask & (ratio > 1.0 + eps_high) & (adv > 0),
    )


def _masked_inputs(mask_BxT, *arrays_BxT):
    mask = jnp.asarray(mask_BxT).astype(bool)
    return (mask,) + tuple(jnp.where(mask, jnp.asarray(x).astype(jnp.float32), 0.0) for x in arrays_BxT)


def _per_token_advantages(advantages, shape):
    """[B] (one per row) or [B, T] (per token, packed rows) -> float32 [B, T]."""
    adv = jnp.asarray(advantages, jnp.float32)
    return jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)


def seq_totals(x_BxT, seq_ids_BxT=None):
    """float32 [B, T]: at each position, the sum of x over its sequence (its row, or its seq id within the row)."""
    x = jnp.asarray(x_BxT, jnp.float32)
    if seq_ids_BxT is None:
        return jnp.broadcast_to(x.sum(-1, keepdims=True), x.shape)
    b, t = x.shape
    flat_ids = (jnp.arange(b)[:, None] * t + jnp.clip(seq_ids_BxT, 0, t - 1)).reshape(-1)
    return jax.ops.segment_sum(x.reshape(-1), flat_ids, num_segments=b * t)[flat_ids].reshape(b, t)


def ppo(logp_BxT, logp_old_BxT, advantages, mask_BxT, *, eps_low: float, eps_high: float,
        dual_clip_c: float | None = None, seq_ids_BxT=None) -> Surrogate:
    """Token-level PPO / GRPO surrogate, ratio exp(logp - logp_old) per token; seq_ids_BxT unused."""
    del seq_ids_BxT
    mask, logp, old = _masked_inputs(mask_BxT, logp_BxT, _sg(logp_old_BxT))
    return clipped_surrogate(logp - old, _per_token_advantages(advantages, mask.shape), mask,
                             eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c)


def gspo(logp_BxT, logp_old_BxT, advantages, mask_BxT, *, eps_low: float, eps_high: float,
         dual_clip_c: float | None = None, seq_ids_BxT=None) -> Surrogate:
    """GSPO: the sequence ratio s_i = exp(mean_t (logp - logp_old)) over the sequence's policy tokens.

    Source: Zheng et al. 2025, GSPO-token form (eq. 13): log s_i in value, d logp_t in gradient.
    """
    mask, logp, old = _masked_inputs(mask_BxT, logp_BxT, _sg(logp_old_BxT))
    seq_log_ratio = seq_totals(logp - old, seq_ids_BxT) / jnp.maximum(seq_totals(mask, seq_ids_BxT), 1.0)
    log_ratio_BxT = _sg(seq_log_ratio) + logp - _sg(logp)
    return clipped_surrogate(log_ratio_BxT, _per_token_advantages(advantages, mask.shape), mask,
                             eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c)


POLICY_LOSSES: dict[str, Callable[..., Surrogate]] = {"ppo": ppo, "gspo": gspo}
# each policy loss's paper settings, used unless a run sets them (Schulman et al. 2017; Zheng et al. 2025)
LOSS_DEFAULTS: dict[str, dict] = {"ppo": {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "token_mean"},
                                  "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}}


# KL to the reference (Schulman 2020, "Approximating KL Divergence"), r = p_ref / p on policy samples; float32
# [B, T], the reference under stop_gradient.
def kl_k1(logp_BxT, logp_ref_BxT):
    """k1 = logp - logp_ref (unbiased, high variance, can be negative; gradient 1 per token)."""
    return jnp.asarray(logp_BxT, jnp.float32) - _sg(jnp.asarray(logp_ref_BxT, jnp.float32))


def kl_k2(logp_BxT, logp_ref_BxT):
    """k2 = (logp - logp_ref)^2 / 2 (biased, low variance, >= 0)."""
    return 0.5 * jnp.square(kl_k1(logp_BxT, logp_ref_BxT))


def kl_k3(logp_BxT, logp_ref_BxT):
    """k3 = exp(logp_ref - logp) - 1 - (logp_ref - logp) (unbiased, >= 0); log ratio clamped to +-20."""
    log_r = jnp.clip(-kl_k1(logp_BxT, logp_ref_BxT), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.exp(log_r) - 1.0 - log_r


KL_ESTIMATORS: dict[str, Callable] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


class LossDenominators(NamedTuple):
    """Float32 denominators of the FULL batch (all microbatches, devices): policy tokens, sequences with one."""

    num_tokens: jax.Array
    num_seqs: jax.Array


def _inverse_seq_lengths(mask, seq_ids_BxT):
    return jnp.where(mask, 1.0 / jnp.maximum(seq_totals(mask, seq_ids_BxT), 1.0), 0.0)


def loss_denominators(loss_mask_BxT, seq_ids_BxT=None) -> LossDenominators:
    """The `LossDenominators` of the FULL batch's {0,1} loss mask (global across devices under jit)."""
    mask = jnp.asarray(loss_mask_BxT).astype(bool)
    num_seqs = _inverse_seq_lengths(mask, seq_ids_BxT).sum()  # each sequence adds len / len = 1
    return LossDenominators(mask.sum().astype(jnp.float32), jnp.round(num_seqs))


def token_mean(x_BxT, mask_BxT, den: LossDenominators, norm_constant=None, seq_ids_BxT=None):
    """sum(x * mask) / den.num_tokens: every policy token in the batch weighs the same (DAPO)."""
    del norm_constant, seq_ids_BxT
    return jnp.where(mask_BxT, x_BxT, 0.0).sum() / jnp.maximum(den.num_tokens, 1.0)


def seq_mean_token_mean(x_BxT, mask_BxT, den: LossDenominators, norm_constant=None, seq_ids_BxT=None):
    """sum_i [sum_{t in i} x_t / len_i] / den.num_seqs: each sequence weighs the same (original GRPO)."""
    del norm_constant
    mask = jnp.asarray(mask_BxT).astype(bool)
    weighted = jnp.where(mask, x_BxT, 0.0) * _inverse_seq_lengths(mask, seq_ids_BxT)
    return weighted.sum() / jnp.maximum(den.num_seqs, 1.0)


def seq_mean_token_sum_norm(x_BxT, mask_BxT, den: LossDenominators, norm_constant=None, seq_ids_BxT=None):
    """sum(x * mask) / norm_constant / den.num_seqs (Dr. GRPO, Liu et al. 2025, eq. 3); ValueError without norm."""
    del seq_ids_BxT
    if norm_constant is None:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs norm_constant (e.g. max response len)")
    return jnp.where(mask_BxT, x_BxT, 0.0).sum() / norm_constant / jnp.maximum(den.num_seqs, 1.0)


AGGREGATIONS: dict[str, Callable] = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                                     "seq_mean_token_sum_norm": seq_mean_token_sum_norm}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Hyperparameters of `policy_loss` (hashable: a static argument); a bad value raises ValueError.

    Attributes:
        policy_loss: a POLICY_LOSSES name.
        eps_low: clip range below 1 of the ratio, in [0, 1).
        eps_high: clip range above 1, >= 0 (DAPO's clip-higher: 0.28 against eps_low 0.2).
        dual_clip_c: None, or the dual-clip bound > 1 on negative-advantage terms (Ye et al. 2020; 3.0 is usual).
        kl_estimator: a KL_ESTIMATORS name.
        beta: KL coefficient, >= 0 (0: no KL term).
        aggregation: an AGGREGATIONS name.
        norm_constant: divisor of seq_mean_token_sum_norm, in tokens (> 0, required by it), or None.
        tis_cap: None, or the cap C > 0 of the TIS weight min(exp(logp_old - logp_sample), C) (Yao et al. 2025).
    """

    policy_loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_estimator: str = "k3"
    beta: float = 0.0
    aggregation: str = "token_mean"
    norm_constant: float | None = None
    tis_cap: float | None = None

    def __post_init__(self):
        for field, table in (("policy_loss", POLICY_LOSSES), ("kl_estimator", KL_ESTIMATORS),
                             ("aggregation", AGGREGATIONS)):
            if getattr(self, field) not in table:
                raise ValueError(f"unknown {field} {getattr(self, field)!r}; valid: {sorted(table)}")
        checks = [
            ("eps_low", self.eps_low, 0 <= self.eps_low < 1, "in [0, 1)"),
            ("eps_high", self.eps_high, self.eps_high >= 0, ">= 0"),
            ("dual_clip_c", self.dual_clip_c, self.dual_clip_c is None or self.dual_clip_c > 1, "None or > 1"),
            ("beta", self.beta, self.beta >= 0, ">= 0"),
            ("tis_cap", self.tis_cap, self.tis_cap is None or self.tis_cap > 0, "None or > 0"),
            ("norm_constant", self.norm_constant,
             (self.norm_constant is None or self.norm_constant > 0)
             and (self.aggregation != "seq_mean_token_sum_norm" or self.norm_constant is not None),
             "> 0 (required by seq_mean_token_sum_norm)"),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"LossConfig.{name} must be {want}, got {value!r}")


def policy_loss(
    logp_BxT, logp_sample_BxT, advantages, loss_mask_BxT, den: LossDenominators, cfg: LossConfig, *,
    logp_old_BxT=None, logp_ref_BxT=None, entropy_BxT=None, seq_ids_BxT=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO-family loss of one microbatch: aggregated surrogate [x TIS weight] + beta * aggregated KL.

    Args:
      logp_sample_BxT: sampler logprobs (constant), only in the TIS weight min(exp(logp_old - logp_sample), tis_cap).
      advantages: float [B], or [B, T] per token (packed rows).
      logp_old_BxT: behaviour-policy trainer logprobs (constant); None: stop_gradient(logp_BxT), a ratio of exactly 1.
      logp_ref_BxT: reference logprobs (constant), required when cfg.beta > 0; entropy_BxT: only logged.

    Returns:
      (loss, metrics): float32 scalars, this microbatch's share of the batch value (MIN_METRICS / MAX_METRICS:
      min / max, +-inf without a policy token); TypeError for another cfg type, ValueError for bad shapes.
    """
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a losses.LossConfig, got {type(cfg).__name__}")
    shape = jnp.shape(loss_mask_BxT)
    named = {"logp_BxT": logp_BxT, "logp_sample_BxT": logp_sample_BxT, "logp_old_BxT": logp_old_BxT,
             "logp_ref_BxT": logp_ref_BxT, "entropy_BxT": entropy_BxT, "seq_ids_BxT": seq_ids_BxT}
    bad = {k: jnp.shape(v) for k, v in named.items() if v is not None and jnp.shape(v) != shape}
    if len(shape) != 2 or bad or jnp.shape(advantages) not in (shape[:1], shape):
        raise ValueError(f"shape mismatch: loss_mask_BxT {shape}, advantages {jnp.shape(advantages)} "
                         f"(want [B] or [B, T]), mismatched: {bad}")
    if cfg.beta > 0 and logp_ref_BxT is None:
        raise ValueError(f"LossConfig.beta={cfg.beta} > 0 needs logp_ref_BxT")
    mask, logp, sample = _masked_inputs(loss_mask_BxT, logp_BxT, _sg(logp_sample_BxT))
    old = _sg(logp) if logp_old_BxT is None else _masked_inputs(mask, _sg(logp_old_BxT))[1]
    aggregate = lambda x: AGGREGATIONS[cfg.aggregation](x, mask, den, cfg.norm_constant, seq_ids_BxT)
    mean = lambda x: token_mean(_sg(x).astype(jnp.float32), mask, den)

    surrogate = POLICY_LOSSES[cfg.policy_loss](logp, old, advantages, mask, eps_low=cfg.eps_low,
                                               eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
                                               seq_ids_BxT=seq_ids_BxT)
    per_token = surrogate.loss_BxT
    metrics = {}
    if cfg.tis_cap is not None:
        tis_BxT = jnp.minimum(jnp.exp(jnp.minimum(old - sample, LOG_RATIO_CLAMP)), cfg.tis_cap)
        tis_BxT = jnp.where(mask, tis_BxT, 0.0)
        per_token = per_token * tis_BxT
        metrics["policy/tis_weight"] = mean(tis_BxT)
    loss = aggregate(per_token)
    if logp_ref_BxT is not None:
        ref = _masked_inputs(mask, logp_ref_BxT)[1]
        kl_BxT = jnp.where(mask, KL_ESTIMATORS[cfg.kl_estimator](logp, ref), 0.0)
        if cfg.beta > 0:
            loss = loss + cfg.beta * aggregate(kl_BxT)
        metrics["policy/kl_ref"] = mean(kl_BxT)
    if entropy_BxT is not None:
        metrics["policy/entropy"] = mean(_masked_inputs(mask, entropy_BxT)[1])
    ratio_BxT = _sg(jnp.exp(jnp.clip(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
    metrics.update({"policy/loss": _sg(loss), "policy/clipfrac_low": mean(surrogate.clipped_low_BxT),
                    "policy/clipfrac_high": mean(surrogate.clipped_high_BxT), "policy/ppo_kl": mean(old - logp),
                    "policy/is_ratio_mean": mean(ratio_BxT),
                    "policy/is_ratio_min": jnp.where(mask, ratio_BxT, jnp.inf).min(),
                    "policy/is_ratio_max": jnp.where(mask, ratio_BxT, -jnp.inf).max()})
    return loss, metrics


# metrics of `policy_loss` (and the train step) that combine across microbatches by min / max, not by sum
MIN_METRICS = ("policy/is_ratio_min",)
MAX_METRICS = ("policy/is_ratio_max", "rollout/logp_diff_max")
