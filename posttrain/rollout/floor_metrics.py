"""Gaming floors of an env mix (the best mean reward a reply without a solution earns; docs/tasks.md) and the reward
above them: `reward/<domain>/above_floor` in training, and the lookup held-out evaluation shares."""
from __future__ import annotations

import json
from typing import Mapping

from posttrain.rollout.env_side import EnvSpec

_FLOORS: dict[tuple[str, str], float | None] = {}


def env_floor(env_id: str, env_kwargs: Mapping) -> float | None:
    """The gaming floor (mean reward in [0, 1]) of the domain an env builds, cached per process; None if unknown."""
    from envs.tasks import floors

    key = (env_id, json.dumps(dict(env_kwargs), sort_keys=True, default=str))
    if key not in _FLOORS:
        try:
            _FLOORS[key] = floors.floor_by_env(env_id, dict(env_kwargs))
        except (KeyError, ValueError):
            _FLOORS[key] = None
    return _FLOORS[key]


def spec_floors(specs: Mapping[str, EnvSpec]) -> dict[str, float | None]:
    """{domain: gaming floor or None} of an env mix (`env_floor` of each spec)."""
    return {name: env_floor(spec.id, spec.kwargs) for name, spec in specs.items()}


def above_floor_metrics(metrics: Mapping[str, float], floors: Mapping[str, float | None]) -> dict[str, float]:
    """{`reward/<domain>/above_floor`: mean reward - floor}; a value <= 0 means a probe earns as much."""
    out = {}
    for domain, floor in floors.items():
        mean = metrics.get(f"reward/{domain}/mean")
        if floor is not None and mean is not None:
            out[f"reward/{domain}/above_floor"] = float(mean) - float(floor)
    return out
