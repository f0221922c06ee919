"""Env step results checked where they become samples (`check_result`, called by `episodes._apply_result` on every
path: `InlineEnvs`, `EnvPool` workers of either backend, streaming scoring, per-episode turns, training and
evaluation alike). An env is user code: what it returns is checked once here, and a malformed result is the env's
fault, never the policy's, so its episode ends as an infra_error (docs/design.md invariant 6) naming the env id, what
is wrong and the value, instead of being scored, coerced or passed on to the advantages. No JAX here.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

log = logging.getLogger(__name__)

# env.max_abs_reward's default: verifiable rewards are 0/1, reward-model and judge sums and shaped rewards stay
# within a few hundred; 1e4 leaves that headroom x 10-100 while a reward that large already means a scale bug.
# Without std normalisation (e.g. rl.advantage=dr_grpo) advantages are reward differences, so the gradient scales
# with the reward: a 1e30 reward overflows float32 to an inf gradient norm and a skipped update
DEFAULT_MAX_ABS_REWARD = 1e4


def check_result(result, env_id: str, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
                 ) -> tuple[Any, float, bool, bool, dict]:
    """One env step's result (of the episode of env `env_id`) checked where it becomes a sample: (obs, reward as a
    float, terminated, truncated, info dict). What the env returned is the env's fault when it is wrong, never the
    policy's: the episode then ends as an infra_error (reward 0.0, truncated, info["status"] "infra_error",
    info["reason"] naming `env_id`, what is wrong and the value; never scored, docs/design.md invariant 6; the job
    scheduler retries it, `env.max_infra_error_rate` bounds a step's share). Refused:

      * a result that is not gymnasium's 5-tuple (obs, reward, terminated, truncated, info), an info that is no
        mapping;
      * an info["status"] that is not one of `envs.verify.answers.STATUSES` (env/*_rate metrics, the archive and
        the job scheduler know only those), or none on the step that ends the episode (a turn that goes on may
        leave it out: its sample's status is then "" until a later step sets it);
      * a reward that is not a real number (`envs.base.as_reward`: int, float, bool as 0/1, numpy integer /
        floating / bool scalars; a str such as "1.0", None, complex, a list or an array is refused, never parsed),
        that is NaN or inf, or whose magnitude exceeds `max_abs_reward` (`env.max_abs_reward`: a reward that large
        is a scale bug, and without std normalisation of advantages it overflows the gradient);
      * an observation that is not a str while the episode goes on (it becomes the next user turn).

    An episode the env itself ended as an infra_error keeps the env's reason (its reward is not read: 0.0)."""
    from envs.base import as_reward, shown_value as _shown
    from envs.verify.answers import STATUSES

    info = None  # the env's info once read: a refused result keeps its other keys

    def fault(why: str):
        log.warning("env %s: %s (the episode ends as infra_error)", env_id, why)
        return "", 0.0, False, True, {**(dict(info) if isinstance(info, Mapping) else {}), "status": "infra_error",
                                      "reason": f"env {env_id!r} {why}"}

    if not isinstance(result, (tuple, list)) or len(result) != 5:
        n = f"{len(result)} items" if isinstance(result, (tuple, list)) else f"a {type(result).__name__}"
        return fault(f"returned a step result of {n}; expected gymnasium's 5 (obs, reward, terminated, truncated, "
                     "info)")
    obs, reward, terminated, truncated, info = result
    if not isinstance(info, Mapping):
        return fault(f"returned info of type {type(info).__name__} ({_shown(info)}); expected a dict")
    status = info.get("status")
    ends = bool(terminated) or bool(truncated)
    if status not in STATUSES and (ends or status is not None):  # a turn that goes on may leave it out
        what = "no info['status'] on the step that ends the episode" if status is None else f"status {_shown(status)}"
        return fault(f"returned {what}; expected one of {STATUSES}")
    if status == "infra_error":  # the env's own fault report: its reason stands
        return obs, 0.0, bool(terminated), True, dict(info)
    value = as_reward(reward)
    if value is None:
        return fault(f"returned reward {_shown(reward)} of type {type(reward).__name__}; a reward must be a real "
                     "number (int, float, bool or a numpy number)")
    if not math.isfinite(value):
        return fault(f"returned a non-finite reward {value!r}")
    if abs(value) > max_abs_reward:
        return fault(f"returned reward {value!r}, beyond env.max_abs_reward={max_abs_reward:g} (a reward scale "
                     "bug? rescale the env's rewards or raise env.max_abs_reward)")
    terminated, truncated = bool(terminated), bool(truncated)
    if not (terminated or truncated) and not isinstance(obs, str):
        return fault(f"returned observation {_shown(obs)} of type {type(obs).__name__} for a next turn; expected "
                     "a str")
    return obs, value, terminated, truncated, dict(info)

