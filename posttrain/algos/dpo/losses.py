"""Preference losses of direct preference optimisation, selected by name (`LOSSES`, `loss_fn(name)`).

Dimension legend:
  P  preference pairs (a prompt with a chosen and a rejected reply)

Every loss takes the pairs' log-ratio difference

    h_P = (log pi(y_w | x) - log pi(y_l | x)) - (log pi_ref(y_w | x) - log pi_ref(y_l | x))

(float32 nats; y_w the chosen reply, y_l the rejected one, pi the policy, pi_ref the frozen reference) with
`beta` (> 0, the strength of the implicit KL constraint) and `label_smoothing` (eps in [0, 0.5): the probability
that a pair's label is flipped), and returns the per-pair loss, float32 [P]:

  sigmoid  -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
           DPO, Rafailov et al. 2023 (arXiv 2305.18290) eq. 7; eps > 0 is conservative DPO (Mitchell 2023,
           "A note on DPO with noisy preferences").
  ipo      (h - 1 / (2 beta))^2
           IPO, Azar et al. 2023 (arXiv 2310.12036) eq. 17; its log-probabilities are the per-token MEAN over the
           reply (`LENGTH_NORMALIZED`), as TRL computes them. eps is not used.
  hinge    max(0, 1 - beta h)
           SLiC-HF's calibration loss, Zhao et al. 2023 (arXiv 2305.10425) eq. 2 with delta = 1 / beta. eps is
           not used.

The implicit rewards (TRL's `rewards/chosen`, `rewards/rejected`) are beta (log pi - log pi_ref) of each reply.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

PreferenceLoss = Callable[[jax.Array, float, float], jax.Array]


def sigmoid_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """DPO's loss (conservative DPO when label_smoothing > 0). float32 [P]."""
    z = beta * jnp.asarray(h_P, jnp.float32)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def ipo_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """IPO's squared loss around the margin 1 / (2 beta). float32 [P]."""
    del label_smoothing
    return (jnp.asarray(h_P, jnp.float32) - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """SLiC's hinge on the scaled log-ratio difference. float32 [P]."""
    del label_smoothing
    return jax.nn.relu(1.0 - beta * jnp.asarray(h_P, jnp.float32))


LOSSES: dict[str, PreferenceLoss] = {"sigmoid": sigmoid_loss, "ipo": ipo_loss, "hinge": hinge_loss}
LENGTH_NORMALIZED = frozenset({"ipo"})  # losses defined on per-token mean log-probabilities


def loss_fn(name: str) -> PreferenceLoss:
    """The registered preference loss `name`. Raises ValueError listing the registered names."""
    if name not in LOSSES:
        raise ValueError(f"unknown DPO loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def check_settings(name: str, beta: float, label_smoothing: float) -> None:
    """Raises ValueError for an unknown loss, beta <= 0, label_smoothing outside [0, 0.5), or label smoothing
    with a loss that does not use it."""
    loss_fn(name)
    if not beta > 0:
        raise ValueError(f"DPO beta must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if label_smoothing and name != "sigmoid":
        raise ValueError(f"label_smoothing={label_smoothing} applies to the 'sigmoid' loss only, not {name!r}")
