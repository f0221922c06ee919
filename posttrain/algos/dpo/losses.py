"""Preference losses of direct preference optimisation, selected by name (`LOSSES`, `loss_fn(name)`).

Shapes: the legend in `posttrain.types`. h_P: (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l)), nats.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

PreferenceLoss = Callable[[jax.Array, float, float], jax.Array]


def sigmoid_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """DPO: -(1 - eps) log sigma(beta h) - eps log sigma(-beta h) (Rafailov et al. 2023, eq. 7; eps: Mitchell 2023)."""
    z = beta * jnp.asarray(h_P, jnp.float32)
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def ipo_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """IPO: (h - 1 / (2 beta))^2, on per-token mean logprobs (Azar et al. 2023, eq. 17); eps unused."""
    del label_smoothing
    return (jnp.asarray(h_P, jnp.float32) - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(h_P, beta: float, label_smoothing: float = 0.0):
    """SLiC-HF: max(0, 1 - beta h) (Zhao et al. 2023, eq. 2, delta = 1 / beta); eps unused."""
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
    """Checks the settings: ValueError for an unknown loss, beta <= 0, or label_smoothing out of [0, 0.5) or unused."""
    loss_fn(name)
    if not beta > 0:
        raise ValueError(f"DPO beta must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if label_smoothing and name != "sigmoid":
        raise ValueError(f"label_smoothing={label_smoothing} applies to the 'sigmoid' loss only, not {name!r}")
