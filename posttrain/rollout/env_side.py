"""The environment side of the rollout phase, built before any model load: env runners, task sources, a worker
probe, the per-step infra-error limit and the `env` config section. Imports no JAX."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from envs.pool.processes import BACKENDS as ENV_BACKENDS
from envs.tasks.task_file import ENV_ID as TASK_FILE_ID  # the env of an entry that names a task file by `path`
from posttrain.errors import AT_LEAST_ONE, NONNEGATIVE, POSITIVE, FieldError, check_fields
from posttrain.rollout import episodes


def make_runner(num_workers: int, step_timeout_s: float, backend: str = "process",
                startup_timeout_s: float = 120.0) -> episodes.EnvRunner:
    """This process's env runner: in-process (num_workers = 0) or an `EnvPool` of `num_workers` `backend` workers.

    Raises ValueError for "ray" with num_workers = 0, ImportError for "ray" without ray."""
    if backend != "process" and num_workers <= 0:
        raise ValueError(f"env backend {backend!r} needs num_workers >= 1, got {num_workers}")
    if num_workers <= 0:
        return episodes.InlineEnvs()
    from envs.pool.processes import EnvPool

    return EnvPool(num_workers=num_workers, step_timeout_s=step_timeout_s, backend=backend,
                   startup_timeout_s=startup_timeout_s)


def env_runner(env_config: "EnvConfig") -> episodes.HostShardedEnvs:
    """The env runner of a config's `env` section: its workers (`make_runner`) and its reward bound."""
    runner = make_runner(env_config.num_workers, env_config.step_timeout_s, env_config.backend,
                         env_config.startup_timeout_s)
    return episodes.HostShardedEnvs(runner, max_abs_reward=env_config.max_abs_reward)


class EnvInfraError(RuntimeError):
    """Too many episodes of a step ended in infra errors (the envs, not the policy, failed)."""


def check_infra_errors(step: int, samples, limit: float) -> None:
    """Raises EnvInfraError, with the first one's reason, when the share of infra-error `samples` exceeds `limit`."""
    bad = [s for s in samples if not s.counts]
    if samples and len(bad) / len(samples) > limit:
        reason = str(bad[0].info.get("reason", "no reason given")).strip().splitlines()
        raise EnvInfraError(f"step {step}: {len(bad)} of {len(samples)} episodes ended in infra errors (more than "
                            f"env.max_infra_error_rate={limit:g}); the first ({bad[0].domain}): "
                            f"{reason[0] if reason else 'no reason given'}")


def probe_workers(episodes: Mapping[str, Any], step_timeout_s: float) -> dict[str, str]:
    """{name: reason} of the episodes an env worker process cannot start (e.g. an env registered only here)."""
    from envs.pool.processes import EnvPool

    names = sorted(episodes)
    with EnvPool(num_workers=1, step_timeout_s=step_timeout_s) as pool:
        out = pool.reset([episodes[n] for n in names])
    return {n: str(info.get("reason", "")) for n, (_, info) in zip(names, out) if info.get("status") == "infra_error"}


class EnvSpecError(ValueError):
    """An env spec that cannot be built; `name` is its key in the env mix, the message names its id and error."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def task_sources(specs: Mapping[str, EnvSpec]) -> dict:
    """{name: (env_id, kwargs, task_source)}; EnvSpecError for an env that cannot be built or fails its self-check."""
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
    """One entry of the env mix.

    Attributes:
        id: a registered gymnasium id (`envs.ENTRY_POINTS`); "" with `path` set: the task-file env.
        weight: mix weight (share of the prompts drawn).
        kwargs: the env's constructor kwargs.
        path: a task file (JSONL, CSV, Parquet or ``tfds:<name>``) to train or evaluate on, no Python needed: the
            spec becomes id "posttrain/TaskFile-v0" with kwargs["path"] = path (docs/task_files.md).
    """

    id: str = ""
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    path: str = ""

    def __post_init__(self):
        if not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise FieldError("weight", self.weight, " is out of range: must be > 0")
        if self.path:
            if self.id not in ("", TASK_FILE_ID):
                raise FieldError("path", self.path, f" is a task file, read by {TASK_FILE_ID}; this entry also names "
                                 f"id={self.id!r}: keep one of the two")
            if "path" in self.kwargs and self.kwargs["path"] != self.path:
                raise FieldError("path", self.path, f" differs from kwargs.path={self.kwargs['path']!r}")
            object.__setattr__(self, "id", TASK_FILE_ID)
            object.__setattr__(self, "kwargs", {**dict(self.kwargs), "path": self.path})
        elif not self.id:
            raise FieldError("id", self.id, " is empty: name a registered env id (e.g. 'posttrain/Arithmetic-v0') or "
                             "set path= to a task file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """The `env` section: the environment mix. Model code always runs in sandboxes.

    Attributes:
        train: mix name -> EnvSpec of the training envs.
        eval: mix name -> EnvSpec of the held-out evaluation envs.
        domains: comma-separated fnmatch patterns of the mix names to keep ("": all).
        num_workers: 0 runs envs in-process (cheap verifiers); > 0 an `EnvPool` of that many workers.
        backend: the env workers' kind: "process" (subprocesses) or "ray" (Ray actors; needs num_workers >= 1).
        step_timeout_s: a worker's limit on one env step (seconds); past it the episode is an infra error.
        startup_timeout_s: a worker's limit on starting and importing its env modules (seconds).
        max_turns: model turns per episode (multi-turn tool / terminal envs).
        max_infra_error_rate: a step whose share of infra-error episodes exceeds it stops the run (1: never).
        max_abs_reward: the largest reward magnitude an env may return (> 0); a larger one is an infra error.
    """

    train: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    eval: Mapping[str, EnvSpec] = dataclasses.field(default_factory=dict)
    domains: str = ""
    num_workers: int = 0
    backend: str = "process"
    step_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    max_turns: int = 1
    max_infra_error_rate: float = 0.5
    max_abs_reward: float = 1e4

    def __post_init__(self):
        check_fields(self, choices={"backend": ENV_BACKENDS}, ranges={
            "max_turns": AT_LEAST_ONE, "num_workers": NONNEGATIVE, "step_timeout_s": POSITIVE,
            "startup_timeout_s": POSITIVE,
            "max_infra_error_rate": ("in [0, 1] (1: never stop)", lambda v: 0 <= v <= 1),
            "max_abs_reward": POSITIVE})
        if self.backend != "process" and self.num_workers < 1:
            raise FieldError("backend", self.backend, f" needs env.num_workers >= 1 (its actors), got "
                             f"env.num_workers={self.num_workers}")
