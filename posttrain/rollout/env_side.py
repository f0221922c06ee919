"""The environment side of the rollout phase, built before any model load: the env runner of this process
(`make_runner`), the task sources of the env specs (`task_sources`, with the golden self-check of every env) and
their errors (`EnvSpecError`), a worker probe (`probe_workers`) and the infra-error limit of a step
(`check_infra_errors`, `EnvInfraError`). Imports no JAX; `rollout.rollouter` builds on it."""
from __future__ import annotations

from typing import Any, Mapping

from posttrain.config import EnvSpec
from posttrain.rollout import episodes as rollout


def make_runner(num_workers: int, step_timeout_s: float, backend: str = "process") -> rollout.EnvRunner:
    """This process's env runner: in-process (num_workers = 0) or an `EnvPool` of `num_workers` workers of kind
    `backend` ("process": subprocesses; "ray": Ray actors, `envs.pool.ray_pool`, on the current Ray cluster or a
    local one). Raises ValueError for another backend, or for "ray" with num_workers = 0; ImportError for "ray"
    without ray."""
    if backend != "process" and num_workers <= 0:
        raise ValueError(f"env backend {backend!r} needs num_workers >= 1, got {num_workers}")
    if num_workers <= 0:
        return rollout.InlineEnvs()
    from envs.pool.processes import EnvPool

    return EnvPool(num_workers=num_workers, step_timeout_s=step_timeout_s, backend=backend)


class EnvInfraError(RuntimeError):
    """Too many episodes of a step ended in infra errors (the envs, not the policy, failed); names the share, the
    limit and the first error."""


def check_infra_errors(step: int, samples, limit: float) -> None:
    """Raises EnvInfraError when the share of `samples` that are infra errors (`Sample.counts` False) exceeds
    `limit`, with the first one's reason (a worker's traceback summary, first line)."""
    bad = [s for s in samples if not s.counts]
    if samples and len(bad) / len(samples) > limit:
        reason = str(bad[0].info.get("reason", "no reason given")).strip().splitlines()
        raise EnvInfraError(f"step {step}: {len(bad)} of {len(samples)} episodes ended in infra errors (more than "
                            f"env.max_infra_error_rate={limit:g}); the first ({bad[0].domain}): "
                            f"{reason[0] if reason else 'no reason given'}")


def probe_workers(episodes: Mapping[str, Any], step_timeout_s: float) -> dict[str, str]:
    """{name: reason} of the episodes ({name: Episode or EpisodeSpec}) an env worker process cannot start: one
    worker resets each once and reports the infra errors. A worker imports `envs` and the module of a
    `module:Env-v0` id, nothing of this process: an env registered only here (e.g. in a config file) fails."""
    from envs.pool.processes import EnvPool

    names = sorted(episodes)
    with EnvPool(num_workers=1, step_timeout_s=step_timeout_s) as pool:
        out = pool.reset([episodes[n] for n in names])
    return {n: str(info.get("reason", "")) for n, (_, info) in zip(names, out) if info.get("status") == "infra_error"}


class EnvSpecError(ValueError):
    """An env spec that cannot be built: `name` is its key in the env mix; the message names its id, its kwargs,
    the env's own error and, for an id that is not registered, the registered ids and the `module:Env-v0` form."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def task_sources(specs: Mapping[str, EnvSpec]) -> dict:
    """{name: (env_id, kwargs, task_source)}; constructing each env runs its golden self-check (invariant 7).
    Raises EnvSpecError (one line) for an env that cannot be built: unknown id, bad kwargs, failed self-check."""
    import gymnasium

    import envs  # noqa: F401

    out = {}
    for name, spec in specs.items():
        try:
            env = gymnasium.make(spec.id, **dict(spec.kwargs)).unwrapped
        except Exception as e:  # noqa: BLE001 - any failure to build is this spec's error, named
            hint = ""
            if isinstance(e, (gymnasium.error.UnregisteredEnv, ImportError)):
                ids = sorted(i for i in gymnasium.registry if i.startswith("posttrain/"))
                hint = (f"; registered posttrain ids: {ids}; an env of your own: 'my.module:MyEnv-v0' (gymnasium "
                        "imports my.module, which registers MyEnv-v0, in every process, env workers included)")
            message = " ".join(f"{type(e).__name__}: {e}".split())
            raise EnvSpecError(name, f"{name}: id={spec.id!r} kwargs={dict(spec.kwargs)}: {message}{hint}") from e
        out[name] = (spec.id, dict(spec.kwargs), env.task_source)
    return out
