"""Pairwise reward-model losses, selected by name (`LOSSES`, `loss_fn(name)`).

Dimension legend:
  P  preference pairs (a prompt with a chosen and a rejected reply)

Each loss takes the rewards of the chosen and the rejected replies (float32 [P], the head's units) and the
reward-centering coefficient `center_coef` (>= 0) and returns the per-pair loss, float32 [P]:

  bradley_terry  -log sigma(r_c - r_r) + center_coef * (r_c + r_r)^2
                 the Bradley-Terry model's negative log-likelihood (Bradley & Terry 1952; InstructGPT, Ouyang et al.
                 2022, arXiv 2203.02155 eq. 1); the centering term keeps rewards near zero (Eisenstein et al. 2023,
                 arXiv 2312.09244), TRL's RewardTrainer `center_rewards_coefficient` (its loss is the mean of both
                 terms over the pairs).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

PairLoss = Callable[[jax.Array, jax.Array, float], jax.Array]


def bradley_terry_loss(r_chosen_P, r_rejected_P, center_coef: float = 0.0):
    """-log sigma(r_c - r_r) + center_coef (r_c + r_r)^2. float32 [P]."""
    rc, rr = jnp.asarray(r_chosen_P, jnp.float32), jnp.asarray(r_rejected_P, jnp.float32)
    return -jax.nn.log_sigmoid(rc - rr) + center_coef * (rc + rr) ** 2


LOSSES: dict[str, PairLoss] = {"bradley_terry": bradley_terry_loss}


def loss_fn(name: str) -> PairLoss:
    """The registered pair loss `name`. Raises ValueError listing the registered names."""
    if name not in LOSSES:
        raise ValueError(f"unknown reward-model loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def check_settings(name: str, center_coef: float) -> None:
    """Raises ValueError for an unknown loss or a negative (or non-finite) center_coef."""
    loss_fn(name)
    if not 0.0 <= center_coef < float("inf"):
        raise ValueError(f"reward-model center_coef must be a finite number >= 0, got {center_coef!r}")
