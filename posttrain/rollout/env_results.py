"""Env step results checked where they become samples: a malformed result is the env's fault, never the policy's,
so its episode ends as an infra_error naming the env id, what is wrong and the value. No JAX here."""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

log = logging.getLogger(__name__)

# env.max_abs_reward's default: verifiable rewards are 0/1, model/judge and shaped rewards stay within a few
# hundred, while without std normalisation (rl.advantage=dr_grpo) a huge reward overflows the gradient
DEFAULT_MAX_ABS_REWARD = 1e4


def check_result(result, env_id: str, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
                 ) -> tuple[Any, float, bool, bool, dict]:
    """Returns one env step's result checked: (obs, reward, terminated, truncated, info dict); never raises.

    A result refused (docs/environments.md) becomes an infra_error: reward 0.0, truncated, info["reason"] naming
    `env_id`, what is wrong and the value."""
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

