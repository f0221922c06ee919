"""Optimizer: global-norm clipping and AdamW (or SGD) under a warm-up + decay schedule (docs/learner.md)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from posttrain.errors import NONNEGATIVE, POSITIVE, check_fields

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimConfig", "Optimizer", "make_optimizer", "make_schedule"]


# --- decay shapes: progress p in [0, 1] -> multiplier of the peak rate, ending at min_lr_ratio.
def _cosine(p, min_lr_ratio):
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p))


def _linear(p, min_lr_ratio):
    return 1.0 - (1.0 - min_lr_ratio) * p


def _constant(p, min_lr_ratio):
    del min_lr_ratio
    return jnp.ones_like(p)


SCHEDULES: dict[str, Callable] = {"cosine": _cosine, "constant": _constant, "linear": _linear}


def make_schedule(
    lr: float, *, warmup_steps: int = 0, total_steps: int | None = None, schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> Callable[[Any], jax.Array]:
    """The learning rate at update `step` (int or int array) -> float32: warm-up, then decay to lr * min_lr_ratio.

    Cosine: Loshchilov & Hutter 2017 (SGDR, eq. 5). Raises ValueError on an unknown schedule, a value out of range,
    or total_steps missing / <= warmup_steps for a decaying schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {sorted(SCHEDULES)}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"schedule {schedule!r} needs total_steps > warmup_steps, got total_steps={total_steps!r}, "
            f"warmup_steps={warmup_steps}"
        )
    decay_steps = max((total_steps or 0) - warmup_steps, 1)
    shape = SCHEDULES[schedule]

    def lr_at(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum((step + 1.0) / max(warmup_steps, 1), 1.0) if warmup_steps else 1.0
        p = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        return (lr * warm * shape(p, min_lr_ratio)).astype(jnp.float32)

    return lr_at


# --- base optimizers: (lr_schedule, b1, b2, eps, weight_decay, weight_decay_mask) -> transformation.
def _adamw(lr_schedule, b1, b2, eps, weight_decay, weight_decay_mask):
    """AdamW, Loshchilov & Hutter 2019 (decoupled decay: p -= lr * weight_decay * p)."""
    return optax.adamw(lr_schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask)


def _adam(lr_schedule, b1, b2, eps, weight_decay, weight_decay_mask):
    """Adam, Kingma & Ba 2015, with coupled L2 (g += weight_decay * p before the moments, as torch.optim.Adam)."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(lr_schedule),
    )


def _sgd(lr_schedule, b1, b2, eps, weight_decay, weight_decay_mask):
    """SGD with heavy-ball momentum b1 (0 = none) and decoupled weight decay; b2 and eps unused."""
    del b2, eps
    return optax.chain(
        optax.trace(decay=b1) if b1 else optax.identity(),
        optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
        optax.scale_by_learning_rate(lr_schedule),
    )


OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {"adam": _adam, "adamw": _adamw, "sgd": _sgd}


class Optimizer(NamedTuple):
    tx: optax.GradientTransformation
    lr_schedule: Callable[[Any], jax.Array]  # update count -> float32 learning rate


def make_optimizer(
    name: str = "adamw",
    *,
    lr: float,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip_norm: float | None = 1.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
    weight_decay_mask: Any = None,
    trainable_mask: Any = None,
) -> Optimizer:
    """Builds `clip_by_global_norm(grad_clip_norm) -> OPTIMIZERS[name]` under `make_schedule(...)`.

    Args:
      name: one of OPTIMIZERS ("adamw", "adam" (coupled L2), "sgd" (b1 is the momentum)).
      lr: peak learning rate. weight_decay: decoupled decay coefficient (>= 0).
      b1, b2, eps: Adam moments' decay rates and denominator epsilon.
      grad_clip_norm: max global L2 norm of the (trainable) gradients; None disables clipping.
      warmup_steps, total_steps, schedule, min_lr_ratio: see `make_schedule`.
      weight_decay_mask: None (decay all) or a pytree / callable(params) of bools, True = decayed.
      trainable_mask: None (train all) or a pytree / callable(params) of bools, True = trainable
        (LoRA: only adapters). Frozen leaves get exactly-zero updates, hold no optimizer state and do
        not count toward the clipping norm.
    Returns:
      Optimizer(tx, lr_schedule); `lr_schedule(step)` is the rate applied at update number `step`.
    Raises:
      ValueError: unknown name or schedule (lists the valid ones), or an out-of-range number.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {sorted(OPTIMIZERS)}")
    for arg, value, ok in (
        ("weight_decay", weight_decay, weight_decay >= 0),
        ("b1", b1, 0 <= b1 < 1),
        ("b2", b2, 0 <= b2 < 1),
        ("eps", eps, eps >= 0),
        ("grad_clip_norm", grad_clip_norm, grad_clip_norm is None or grad_clip_norm > 0),
    ):
        if not ok:
            raise ValueError(f"{arg} out of range: {value!r}")
    lr_schedule = make_schedule(
        lr, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio
    )
    tx = OPTIMIZERS[name](lr_schedule, b1, b2, eps, weight_decay, weight_decay_mask)
    if grad_clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
    if trainable_mask is not None:
        tx = optax.multi_transform(
            {"trainable": tx, "frozen": optax.set_to_zero()}, _labels(trainable_mask)
        )
    return Optimizer(tx, lr_schedule)


def _labels(trainable_mask):
    to_label = lambda mask: jax.tree.map(lambda m: "trainable" if m else "frozen", mask)
    if callable(trainable_mask):
        return lambda params: to_label(trainable_mask(params))
    return to_label(trainable_mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The `optim` section (`make_optimizer`).

    Attributes:
        name: adamw | adam | sgd.
        lr: peak learning rate.
        weight_decay: weight decay (decoupled, but coupled L2 for adam).
        b1: Adam's first-moment decay (sgd: the momentum).
        b2: Adam's second-moment decay.
        eps: Adam's epsilon.
        grad_clip_norm: clip the global L2 norm of the gradient to this (0: off).
        warmup_steps: linear warmup from 0 to lr over this many steps.
        schedule: constant | cosine | linear, decaying to lr * min_lr_ratio at train.steps.
        min_lr_ratio: the schedule's final learning rate as a fraction of lr.
    """

    name: str = "adamw"
    lr: float = 1e-5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        check_fields(self, choices={"name": OPTIMIZERS, "schedule": SCHEDULES}, ranges={
            "lr": POSITIVE, "weight_decay": NONNEGATIVE, "grad_clip_norm": (">= 0 (0: off)", lambda v: v >= 0),
            "warmup_steps": NONNEGATIVE, "b1": ("in [0, 1)", lambda v: 0 <= v < 1),
            "b2": ("in [0, 1)", lambda v: 0 <= v < 1), "eps": POSITIVE,
            "min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1)})

    def build(self, total_steps: int | None = None, **masks) -> Optimizer:
        """`make_optimizer` with these settings over `total_steps` updates (`masks`: its two masks)."""
        return make_optimizer(self.name, lr=self.lr, weight_decay=self.weight_decay, b1=self.b1, b2=self.b2,
                              eps=self.eps, grad_clip_norm=self.grad_clip_norm or None,
                              warmup_steps=self.warmup_steps, total_steps=total_steps, schedule=self.schedule,
                              min_lr_ratio=self.min_lr_ratio, **masks)
