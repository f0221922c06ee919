"""Pairwise reward-model losses, selected by name (`LOSSES`, `loss_fn(name)`): float32 [P] from the pair's rewards.

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

PairLoss = Callable[[jax.Array, jax.Array, float], jax.Array]


def bradley_terry_loss(r_chosen_P, r_rejected_P, center_coef: float = 0.0):
    """Bradley-Terry NLL -log sigma(r_c - r_r) (Ouyang et al. 2022) + center_coef (r_c + r_r)^2 (Eisenstein 2023)."""
    rc, rr = jnp.asarray(r_chosen_P, jnp.float32), jnp.asarray(r_rejected_P, jnp.float32)
    return -jax.nn.log_sigmoid(rc - rr) + center_coef * (rc + rr) ** 2


LOSSES: dict[str, PairLoss] = {"bradley_terry": bradley_terry_loss}


def loss_fn(name: str) -> PairLoss:
    """The registered pair loss `name`. Raises ValueError listing the registered names."""
    if name not in LOSSES:
        raise ValueError(f"unknown reward-model loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def check_settings(name: str, center_coef: float) -> None:
    """Checks the settings: ValueError for an unknown loss or a negative (or non-finite) center_coef."""
    loss_fn(name)
    if not 0.0 <= center_coef < float("inf"):
        raise ValueError(f"reward-model center_coef must be a finite number >= 0, got {center_coef!r}")
