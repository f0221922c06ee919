"""Group-relative advantages over verifiable rewards (GRPO family): float32, jit-compatible, shape-static.

Shapes: the legend in `posttrain.types`. Invalid samples and signal-free groups get exactly 0 (docs/algorithms.md).
"""

from __future__ import annotations

import functools

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ADVANTAGES",
    "Advantages",
    "compute_advantages",
    "dr_grpo",
    "grpo",
    "rloo",
]


class Advantages(NamedTuple):
    """An estimator's result: float32 advantages in the rewards' layout; zero_std_P: True for a signal-free group."""

    advantages: jnp.ndarray
    zero_std_P: jnp.ndarray


class _GroupStats(NamedTuple):
    rewards_PxG: jnp.ndarray  # float32, 0 at invalid samples
    valid_PxG: jnp.ndarray  # bool
    count_P: jnp.ndarray  # float32 number of valid samples per group
    mean_P: jnp.ndarray  # float32 mean over valid samples (0 for empty groups)
    zero_std_P: jnp.ndarray  # bool


def _check_pxg(rewards_PxG, valid_PxG) -> None:
    if jnp.ndim(rewards_PxG) != 2:
        raise ValueError(f"rewards_PxG must be 2-D [P, G], got shape {jnp.shape(rewards_PxG)}")
    if valid_PxG is not None and jnp.shape(valid_PxG) != jnp.shape(rewards_PxG):
        raise ValueError(
            f"valid_PxG shape {jnp.shape(valid_PxG)} != rewards_PxG shape {jnp.shape(rewards_PxG)}"
        )


def _group_stats(rewards_PxG, valid_PxG) -> _GroupStats:
    """Sanitises invalid samples (NaN rewards there cannot leak) and computes the group mean."""
    _check_pxg(rewards_PxG, valid_PxG)
    rewards_PxG = jnp.asarray(rewards_PxG, jnp.float32)
    if valid_PxG is None:
        valid_PxG = jnp.ones(rewards_PxG.shape, bool)
    valid_PxG = jnp.asarray(valid_PxG).astype(bool)
    r = jnp.where(valid_PxG, rewards_PxG, 0.0)
    count_P = valid_PxG.sum(axis=1).astype(jnp.float32)
    mean_P = r.sum(axis=1) / jnp.maximum(count_P, 1.0)
    # Exact test for "all valid rewards equal": max == min over valid samples. No tolerance: a
    # group that differs at all is a real signal (e.g. seven 0.35 and one 0.0).
    r_max = jnp.where(valid_PxG, rewards_PxG, -jnp.inf).max(axis=1)
    r_min = jnp.where(valid_PxG, rewards_PxG, jnp.inf).min(axis=1)
    zero_std_P = (count_P < 2) | (r_max == r_min)
    return _GroupStats(r, valid_PxG, count_P, mean_P, zero_std_P)


def _finish(stats: _GroupStats, adv_PxG) -> Advantages:
    """Forces exact zeros for invalid samples and signal-free groups."""
    keep = stats.valid_PxG & ~stats.zero_std_P[:, None]
    return Advantages(jnp.where(keep, adv_PxG, 0.0).astype(jnp.float32), stats.zero_std_P)


def grpo(rewards_PxG, valid_PxG=None, *, std_eps: float = 1e-6) -> Advantages:
    """GRPO advantage: (r - mean_group) / (std_group + std_eps).

    Source: Shao et al. 2024, "DeepSeekMath" (GRPO outcome supervision), eq. in sec. 4.1.2.
    Statistics are over the valid samples of each group; std is the unbiased sample std
    (ddof=1, as torch.std in TRL and verl).

    Args:
      rewards_PxG: float [P, G] rewards (any unit); values at invalid samples are ignored (may be NaN).
      valid_PxG: bool [P, G] or None (all valid).
      std_eps: added to the std before dividing (unit of the rewards).
    Returns:
      Advantages(advantages=float32 [P, G], zero_std_P=bool [P]).
    Raises:
      ValueError: rewards not 2-D or valid of another shape.
    """
    s = _group_stats(rewards_PxG, valid_PxG)
    centred = jnp.where(s.valid_PxG, s.rewards_PxG - s.mean_P[:, None], 0.0)
    var_P = (centred**2).sum(axis=1) / jnp.maximum(s.count_P - 1.0, 1.0)
    return _finish(s, centred / (jnp.sqrt(var_P)[:, None] + std_eps))


def dr_grpo(rewards_PxG, valid_PxG=None) -> Advantages:
    """Dr. GRPO advantage: r - mean_group, no std division (Liu et al. 2025, sec. 3.2); otherwise as `grpo`."""
    s = _group_stats(rewards_PxG, valid_PxG)
    return _finish(s, s.rewards_PxG - s.mean_P[:, None])


def rloo(rewards_PxG, valid_PxG=None) -> Advantages:
    """RLOO advantage: r_i - mean_{j != i} r_j over the valid samples (Ahmadian et al. 2024, eq. 6); else as `grpo`."""
    s = _group_stats(rewards_PxG, valid_PxG)
    n = s.count_P[:, None]
    return _finish(s, (s.rewards_PxG - s.mean_P[:, None]) * n / jnp.maximum(n - 1.0, 1.0))


ADVANTAGES: dict[str, Callable[..., Advantages]] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def compute_advantages(
    name: str,
    rewards_B,
    valid_B=None,
    *,
    group_size: int,
    group_id_B=None,
    **kwargs,
) -> Advantages:
    """Advantages for a flat batch whose groups are contiguous runs of `group_size` samples.

    Args:
      name: one of ADVANTAGES ("grpo", "dr_grpo", "rloo").
      rewards_B: float [B] rewards, B = P * group_size, sample b in group b // group_size.
      valid_B: bool [B] or None (all valid); invalid samples get 0 and are left out of the statistics.
      group_size: G, a static Python int.
      group_id_B: optional int [B]; when concrete (not traced), checked to be constant within each
        run of G samples and different between consecutive groups, so a wrong layout fails loudly.
      **kwargs: passed to the estimator (e.g. std_eps for grpo).
    Returns:
      Advantages(advantages=float32 [B], zero_std_P=bool [P]).
    Raises:
      ValueError: unknown name (lists the valid ones), B not divisible by group_size, shape mismatch,
        or group ids that are not laid out in contiguous groups of group_size.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGES)}")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if jnp.ndim(rewards_B) != 1 or jnp.shape(rewards_B)[0] % group_size:
        raise ValueError(
            f"rewards_B must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {jnp.shape(rewards_B)}"
        )
    for arg_name, arr in (("valid_B", valid_B), ("group_id_B", group_id_B)):
        if arr is not None and jnp.shape(arr) != jnp.shape(rewards_B):
            raise ValueError(f"{arg_name} shape {jnp.shape(arr)} != rewards_B shape {jnp.shape(rewards_B)}")
    num_groups = jnp.shape(rewards_B)[0] // group_size
    if group_id_B is not None and not isinstance(group_id_B, jax.core.Tracer):
        ids_PxG = np.asarray(group_id_B).reshape(num_groups, group_size)
        if (ids_PxG != ids_PxG[:, :1]).any() or (ids_PxG[1:, 0] == ids_PxG[:-1, 0]).any():
            raise ValueError(
                f"group_id_B is not laid out as contiguous groups of {group_size}: {ids_PxG.tolist()}"
            )
    reshape = lambda x: None if x is None else jnp.reshape(x, (num_groups, group_size))
    out = ADVANTAGES[name](reshape(rewards_B), reshape(valid_B), **kwargs)
    return Advantages(out.advantages.reshape(-1), out.zero_std_P)


def advantage_fn(name: str, **kwargs) -> Callable[[Any, Any, int], Advantages]:
    """The rollout's `posttrain.rollout.batching.AdvantageFn` of estimator `name` (ValueError if unknown)."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGES)}")
    return functools.partial(_flat_advantages, name, **kwargs)


def _flat_advantages(name, rewards_B, valid_B, group_size, **kwargs) -> Advantages:
    return compute_advantages(name, rewards_B, valid_B, group_size=group_size, **kwargs)
