"""Policy-gradient losses for RL post-training: clipped surrogates, KL, aggregation.

Dimension legend:
  B  sequences in the (micro)batch
  T  token positions (padded sequence width)

Conventions:
  * A token's logprob is `log_softmax(logits / temperature)[target]` over the full vocabulary, in
    float32 (docs/design.md invariant 1), defined in `posttrain.learn.logprobs` (re-exported here).
  * Masked positions are sanitised with `jnp.where` before any arithmetic (invariant 4), so NaN/inf
    there (e.g. in the sampler's logprobs of padding) reach neither the loss nor its gradient.
  * Rows may be packed (one prompt followed by its G completions): `seq_ids_BxT` (int in [0, T), any id
    unique per completion within its row, e.g. the position of its first token) then tells which
    sequence each token belongs to, and advantages may be given per token ([B, T]) instead of per
    row ([B]). Without seq_ids every row is one sequence.
  * Aggregation is global (invariant 3): the caller computes `LossDenominators` once over the FULL
    batch (all microbatches, all devices); each microbatch's loss and metrics are then its share of
    the batch value, so summing them over microbatches and devices gives exactly the full-batch value.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from posttrain.learn.logprobs import (  # noqa: F401  (re-exported: the token logprob definition lives there)
    LogprobsOut, chunked_token_logprobs, token_entropy, token_logprobs, valid_first_order)

# |log ratio| is clamped here before exp() so a stale or broken token cannot overflow to inf
# (verl uses the same bound); the gradient is zero beyond it.
LOG_RATIO_CLAMP = 20.0
_sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- surrogates
class Surrogate(NamedTuple):
    loss_BxT: jax.Array  # float32 per-token loss, 0 at masked positions
    clipped_low_BxT: jax.Array  # bool: ratio < 1 - eps_low with A < 0 (lower clip active)
    clipped_high_BxT: jax.Array  # bool: ratio > 1 + eps_high with A > 0 (upper clip active)


def clipped_surrogate(log_ratio_BxT, advantages_BxT, mask_BxT, *, eps_low: float, eps_high: float,
                      dual_clip_c: float | None = None) -> Surrogate:
    """PPO clipped surrogate, as a loss: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(log_ratio).

    Sources: Schulman et al. 2017 (PPO, eq. 7); decoupled eps_low / eps_high ("clip-higher"):
    Yu et al. 2025 (DAPO, eq. 10); dual clip for A < 0, loss capped at -c A with c > 1:
    Ye et al. 2020 ("Mastering Complex Control in MOBA Games", eq. 5).
    Inputs are float [B, T] (advantages already broadcast per token) and a {0,1} mask; the log ratio is
    clamped to +-LOG_RATIO_CLAMP before exp. Masked positions are sanitised first.
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
    """float32 [B, T]: at each position, the sum of x over the tokens of that position's sequence.

    A sequence is a row (seq_ids_BxT None) or the tokens of a row sharing an id in [0, T).
    """
    x = jnp.asarray(x_BxT, jnp.float32)
    if seq_ids_BxT is None:
        return jnp.broadcast_to(x.sum(-1, keepdims=True), x.shape)
    b, t = x.shape
    flat_ids = (jnp.arange(b)[:, None] * t + jnp.clip(seq_ids_BxT, 0, t - 1)).reshape(-1)
    return jax.ops.segment_sum(x.reshape(-1), flat_ids, num_segments=b * t)[flat_ids].reshape(b, t)


def ppo(logp_BxT, logp_old_BxT, advantages, mask_BxT, *, eps_low: float, eps_high: float,
        dual_clip_c: float | None = None, seq_ids_BxT=None) -> Surrogate:
    """Token-level PPO / GRPO surrogate with ratio exp(logp - logp_old) per token (see clipped_surrogate).

    logp_BxT is differentiable; logp_old_BxT is treated as a constant; advantages is [B] or [B, T];
    seq_ids_BxT is unused (uniform signature).
    """
    del seq_ids_BxT
    mask, logp, old = _masked_inputs(mask_BxT, logp_BxT, _sg(logp_old_BxT))
    return clipped_surrogate(logp - old, _per_token_advantages(advantages, mask.shape), mask,
                             eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c)


def gspo(logp_BxT, logp_old_BxT, advantages, mask_BxT, *, eps_low: float, eps_high: float,
         dual_clip_c: float | None = None, seq_ids_BxT=None) -> Surrogate:
    """GSPO: sequence-level ratio s_i = exp(mean_t (logp - logp_old)) over the sequence's policy tokens.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (eq. 7; GSPO-token form, eq. 13):
    every token carries log s_i in value and d logp_t in gradient, so with `seq_mean_token_mean`
    aggregation the loss and gradient are exactly GSPO's. Clip ranges in the paper are ~3e-4 / 4e-4.
    Sequences are rows, or the runs of seq_ids_BxT for packed rows.
    """
    mask, logp, old = _masked_inputs(mask_BxT, logp_BxT, _sg(logp_old_BxT))
    seq_log_ratio = seq_totals(logp - old, seq_ids_BxT) / jnp.maximum(seq_totals(mask, seq_ids_BxT), 1.0)
    log_ratio_BxT = _sg(seq_log_ratio) + logp - _sg(logp)
    return clipped_surrogate(log_ratio_BxT, _per_token_advantages(advantages, mask.shape), mask,
                             eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c)


POLICY_LOSSES: dict[str, Callable[..., Surrogate]] = {"ppo": ppo, "gspo": gspo}
# each policy loss's own settings, used unless a run sets them: ppo: clip 0.2 (Schulman et al. 2017) over every
# token (DAPO's token_mean); gspo: the clip ranges 3e-4 / 4e-4 of its sequence ratio and its objective's mean over
# the group's sequences, each weighing the same (Zheng et al. 2025, "Group Sequence Policy Optimization",
# arXiv:2507.18071)
LOSS_DEFAULTS: dict[str, dict] = {"ppo": {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "token_mean"},
                                  "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}}


# ----------------------------------------------------------------------------- KL to the reference
# Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with samples from
# the policy and r = p_ref / p: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (>= 0, unbiased).
# Elementwise float32 [B, T]; the reference is wrapped in stop_gradient (gradient reaches the policy only).
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


# ----------------------------------------------------------------------------- aggregation
class LossDenominators(NamedTuple):
    """Global denominators, computed once over the FULL batch (all microbatches and devices).

    num_tokens: float32 scalar, total policy tokens (sum of loss_mask).
    num_seqs: float32 scalar, sequences with at least one policy token (others add nothing to any sum).
    """

    num_tokens: jax.Array
    num_seqs: jax.Array


def _inverse_seq_lengths(mask, seq_ids_BxT):
    """float32 [B, T]: 1 / (policy tokens of the position's sequence) on policy tokens, 0 elsewhere."""
    return jnp.where(mask, 1.0 / jnp.maximum(seq_totals(mask, seq_ids_BxT), 1.0), 0.0)


def loss_denominators(loss_mask_BxT, seq_ids_BxT=None) -> LossDenominators:
    """LossDenominators of the FULL batch's {0,1} loss mask [B, T] (and seq ids for packed rows).

    Under jit, sums over a global (sharded) array are global across devices.
    """
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
    """sum(x * mask) / norm_constant / den.num_seqs; norm_constant is a config constant such as the max
    response length, never a padded width (Dr. GRPO, Liu et al. 2025, eq. 3). Raises ValueError if None."""
    del seq_ids_BxT
    if norm_constant is None:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs norm_constant (e.g. max response len)")
    return jnp.where(mask_BxT, x_BxT, 0.0).sum() / norm_constant / jnp.maximum(den.num_seqs, 1.0)


AGGREGATIONS: dict[str, Callable] = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                                     "seq_mean_token_sum_norm": seq_mean_token_sum_norm}


# ----------------------------------------------------------------------------- composed loss
@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Hyperparameters of `policy_loss` (hashable: usable as a static argument). Raises ValueError (naming the
    field and the valid values) on bad settings.

    Attributes:
        policy_loss: a POLICY_LOSSES name.
        eps_low: clip range below 1 of the ratio (in [0, 1)).
        eps_high: clip range above 1 (>= 0; DAPO's clip-higher: 0.28 against eps_low 0.2).
        dual_clip_c: None, or the dual-clip bound > 1 on negative-advantage terms (Ye et al. 2020; 3.0 is usual).
        kl_estimator: a KL_ESTIMATORS name.
        beta: KL coefficient (>= 0; 0 disables the KL term).
        aggregation: an AGGREGATIONS name.
        norm_constant: divisor for seq_mean_token_sum_norm, in tokens (> 0; required by it), or None.
        tis_cap: None, or the cap C > 0 of the truncated importance weight min(exp(logp_old - logp_sample), C)
            (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
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
    """The GRPO-family loss of one microbatch: aggregated surrogate [* TIS weight] + beta * aggregated KL.

    Args:
      logp_BxT: trainer logprobs of the sampled tokens (differentiable), float [B, T].
      logp_sample_BxT: the sampler's logprobs of the same tokens (constant).
      advantages: float [B] (one per row) or [B, T] (per token, for packed rows).
      loss_mask_BxT: {0,1} [B, T], 1 on policy tokens only.
      den: LossDenominators of the FULL batch (see `loss_denominators`, same seq_ids).
      cfg: LossConfig.
      logp_old_BxT: optional trainer logprobs under the behaviour policy (constant), computed by the trainer
        before the first of several updates on one batch. The ratio's denominator is logp_old_BxT if given, else
        stop_gradient(logp_BxT): with one update per batch the behaviour policy IS the current policy, so the
        ratio is exactly 1 in any dtype (docs/design.md invariant 1). The sampler's logprobs never enter the ratio
        (a different computation: bf16 kernels differ by ~1e-2 in logprob); they are the behaviour policy of
        truncated importance sampling only: with cfg.tis_cap every token's loss is weighted by the constant
        min(exp(logp_old - logp_sample), tis_cap).
      logp_ref_BxT: reference-model logprobs (constant); required when cfg.beta > 0.
      entropy_BxT: optional per-token entropy, only logged.
      seq_ids_BxT: optional int [B, T] sequence ids within packed rows (see the module docstring).
    Returns:
      (loss, metrics): float32 scalars, each this microbatch's share of the batch value (sum them over
      microbatches and devices). Metric keys: policy/loss, policy/clipfrac_low, policy/clipfrac_high,
      policy/ppo_kl (token mean of logp_old - logp), policy/is_ratio_mean (token mean of exp(logp - logp_old)),
      and when applicable policy/kl_ref (token mean of the estimator), policy/entropy, policy/tis_weight.
      Reduced with min / max instead of a sum (see MIN_METRICS / MAX_METRICS): policy/is_ratio_min and
      policy/is_ratio_max (+inf / -inf when the microbatch has no policy token). Metrics carry no gradient.
    Raises:
      TypeError if cfg is not a LossConfig; ValueError on shape mismatch or beta > 0 without logp_ref_BxT.
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
