"""Evaluation suites: named domains grouped into capability areas, read from `configs/eval/<name>.py`.

A suite file defines ``get_suite() -> dict``::

    {"name": "default",                   # the suite's name (reports are written under it)
     "alpha": 0.05,                       # family-wise level of the verdicts (Holm across the suite's domains)
     "defaults": {...},                   # domain settings every entry inherits (keys below)
     "areas": {"arithmetic": {"trained": True, "domains": {"arithmetic": {"env": "posttrain/Arithmetic-v0"}}},
               "logic": {"domains": {"reasoning_gym/gcd": {"config": {"max_value": 50}}}}}}

Domain settings (`SuiteDomain`): env (a registered gymnasium id, `envs.ENTRY_POINTS`; without it the domain name is
a pattern of the domain registry `envs.tasks.domains`, e.g. "reasoning_gym/gcd" or "reasoning_gym/count_*", built
through `domains.select` and its golden check), kwargs (env constructor kwargs), config (registry domains: dataset
config overrides), split (passed as the env's `split` kwarg; None for an env with one task set), tasks (the first
this many tasks), n (samples per task), k (pass@k values; each needs n >= 2k), temperature (0: greedy, then n = 1
and no k), max_new_tokens (the token budget of one turn), max_turns, scorer (`runner.SCORERS`), format
(`runner.FORMATS`, the answer format a reply must follow), trained (the policy trains on this domain).

`resolve` builds every domain's task source; a domain that cannot be built (its data is absent, its package is not
installed, its golden check fails) is skipped with a one-line reason instead of failing the suite. No JAX here.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import json
import pathlib
from typing import Any, Mapping, Sequence

from posttrain.config import EnvSpec
from posttrain.eval.runner import FORMATS, SCORERS, spec_floors

DOMAIN_KEYS = ("env", "kwargs", "config", "split", "tasks", "n", "k", "temperature", "max_new_tokens", "max_turns",
               "scorer", "format", "trained")
REGISTRY_PREFIXES = ("reasoning_gym/",)  # domain names built through envs.tasks.domains


class DomainUnavailable(RuntimeError):
    """A registry domain whose golden check does not pass: it is skipped, not evaluated."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteDomain:
    """One domain of a suite (see the module docstring for each field). ks: the pass@k values (k >= 2)."""

    name: str
    area: str
    env: str = ""
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    split: str | None = "test"
    tasks: int = 50
    n: int = 1
    ks: tuple[int, ...] = ()
    temperature: float = 0.0
    max_new_tokens: int = 64
    max_turns: int = 1
    scorer: str = "env"
    format: str = "nonempty"
    trained: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Suite:
    """A suite: its name, the file it came from, alpha, and its domains in file order."""

    name: str
    path: str
    alpha: float
    domains: tuple[SuiteDomain, ...]

    def area_of(self) -> dict[str, str]:
        return {d.name: d.area for d in self.domains}


@dataclasses.dataclass(frozen=True)
class ResolvedDomain:
    """A domain ready to sample: its settings, env spec, task source and task count (<= settings.tasks)."""

    domain: SuiteDomain
    spec: EnvSpec
    source: Any  # envs.base.TaskSource
    num_tasks: int


def load_suite(path: str | pathlib.Path) -> Suite:
    """The suite defined by `get_suite()` in the Python file `path`. Raises FileNotFoundError for a missing file and
    ValueError (naming the file, the domain and the key) for a malformed suite."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--suite={path}: no such file (suites live in configs/eval/*.py)")
    spec = importlib.util.spec_from_file_location(f"suite_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_suite"):
        raise ValueError(f"{path}: a suite file defines get_suite() -> dict")
    return parse_suite(module.get_suite(), str(path))


def parse_suite(raw: Mapping, path: str = "<suite>") -> Suite:
    """A validated Suite from the dict a suite file returns (see the module docstring)."""
    unknown = sorted(set(raw) - {"name", "alpha", "defaults", "areas"})
    if unknown or "areas" not in raw or not raw["areas"]:
        raise ValueError(f"{path}: a suite has keys name, alpha, defaults, areas (non-empty); got {sorted(raw)}")
    alpha = float(raw.get("alpha", 0.05))
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{path}: alpha must be in (0, 1), got {alpha}")
    defaults = dict(raw.get("defaults", {}))
    domains: list[SuiteDomain] = []
    for area, block in raw["areas"].items():
        if not isinstance(block, Mapping) or set(block) - {"trained", "domains"} or not block.get("domains"):
            raise ValueError(f"{path}: area {area!r} is a dict with 'domains' (non-empty) and optional 'trained'")
        for name, entry in block["domains"].items():
            merged = {"trained": bool(block.get("trained", False)), **defaults, **dict(entry or {})}
            for expanded in _expand(name, merged):
                domains.append(_domain(expanded, area, merged, path))
    names = [d.name for d in domains]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: domains appear more than once: {repeated}")
    return Suite(str(raw.get("name", pathlib.Path(path).stem)), path, alpha, tuple(domains))


def _expand(name: str, entry: Mapping) -> list[str]:
    """The registry domains a name without "env" stands for (a pattern may match several); [name] otherwise."""
    if entry.get("env") or not any(ch in name for ch in "*?["):
        return [name]
    from envs.tasks import domains as registry

    return registry.match_domains(name)


def _domain(name: str, area: str, entry: Mapping, path: str) -> SuiteDomain:
    where = f"{path}: domain {name!r}"
    unknown = sorted(set(entry) - set(DOMAIN_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {list(DOMAIN_KEYS)}")
    if not entry.get("env") and not name.startswith(REGISTRY_PREFIXES):
        raise ValueError(f"{where}: give 'env' (a gymnasium id) or name a registry domain ({REGISTRY_PREFIXES})")
    fields = {k: entry[k] for k in DOMAIN_KEYS if k in entry and k != "k"}
    d = SuiteDomain(name=name, area=str(area), ks=tuple(sorted({int(k) for k in entry.get("k", ())} - {1})),
                    **fields)
    _check_domain(d, where)
    return d


def _check_domain(d: SuiteDomain, where: str) -> None:
    def is_int(x, low):
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    problems = [f"{key}={getattr(d, key)!r} must be an int >= 1" for key in ("tasks", "n", "max_new_tokens",
                                                                             "max_turns") if not is_int(getattr(d, key), 1)]
    if not (isinstance(d.temperature, (int, float)) and d.temperature >= 0):
        problems.append(f"temperature={d.temperature!r} must be >= 0")
    elif d.greedy and (d.n != 1 or d.ks):
        problems.append(f"temperature 0 (greedy) has one sample per task and no pass@k, got n={d.n}, k={list(d.ks)}")
    short = [k for k in d.ks if d.n < 2 * k or k < 1]
    if short:
        problems.append(f"pass@k needs n >= 2k samples (Chen et al. 2021), got n={d.n} for k={short}")
    if d.scorer not in SCORERS:
        problems.append(f"scorer={d.scorer!r} is not one of {sorted(SCORERS)}")
    if d.format not in FORMATS:
        problems.append(f"format={d.format!r} is not one of {sorted(FORMATS)}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def select(suite: Suite, *, limit: int | None = None, domains: str | Sequence[str] | None = None) -> Suite:
    """The suite cut to the domains matching a pattern of `domains` (names or fnmatch patterns, comma-separated)
    and to at most `limit` tasks per domain. Raises ValueError for a pattern matching no domain or limit < 1."""
    kept = list(suite.domains)
    if domains:
        patterns = [p.strip() for p in domains.split(",")] if isinstance(domains, str) else list(domains)
        patterns = [p for p in patterns if p]
        for p in patterns:
            if not any(fnmatch.fnmatchcase(d.name, p) for d in kept):
                raise ValueError(f"--domains: {p!r} matches no domain of suite {suite.name!r}: "
                                 f"{[d.name for d in suite.domains]}")
        kept = [d for d in kept if any(fnmatch.fnmatchcase(d.name, p) for p in patterns)]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        kept = [dataclasses.replace(d, tasks=min(d.tasks, limit)) for d in kept]
    return dataclasses.replace(suite, domains=tuple(kept))


def env_spec_of(d: SuiteDomain) -> EnvSpec:
    """The EnvSpec of a domain: its env and kwargs (+ split), or for a registry domain the spec
    `envs.tasks.domains.select` builds (split, num_test = tasks, the dataset config) with the domain's kwargs.
    Raises DomainUnavailable for a registry domain whose golden check or golden sample (`envs.tasks.floors`)
    fails, ValueError for an unknown one. A domain flagged by its gaming floor is evaluated (its summary reports
    mean reward above the floor)."""
    if d.env:
        kwargs = dict(d.kwargs) if d.split is None else {**dict(d.kwargs), "split": d.split}
        return EnvSpec(id=d.env, kwargs=kwargs)
    from envs.tasks import domains as registry

    from envs.tasks import floors

    config = {**registry.default_config(d.name), **dict(d.config)}
    check = registry.check_domain(d.name, config=config)
    if check.status not in registry.TRAINABLE:
        raise DomainUnavailable(f"golden check {check.status}: {check.reason}")
    sampled = floors.assessment(d.name, config)
    if sampled.golden == "failed":
        raise DomainUnavailable(f"golden sample failed: {sampled.reason}")
    entry = {"pattern": d.name, "allow_flagged": True, **({"config": dict(d.config)} if d.config else {})}
    specs, _ = registry.select([entry], split=d.split or "test", num_test=d.tasks, size=max(d.tasks, 1000))
    spec = specs[d.name]
    return EnvSpec(id=spec["id"], kwargs={**spec["kwargs"], **dict(d.kwargs)})


def resolve(suite: Suite) -> tuple[list[ResolvedDomain], dict[str, str]]:
    """(the domains that build, in suite order; {skipped domain: one-line reason}). Constructing each env runs its
    golden self-check. Absent data (FileNotFoundError, OSError), a missing package (ImportError), a failed golden
    check (DomainUnavailable) or self-check (RuntimeError) skip the domain; other errors (a bad kwarg: TypeError,
    ValueError) propagate."""
    import gymnasium

    import envs  # noqa: F401  (registers the env ids)

    built, skipped = [], {}
    for d in suite.domains:
        try:
            spec = env_spec_of(d)
            env = gymnasium.make(spec.id, **dict(spec.kwargs)).unwrapped
        except (DomainUnavailable, OSError, ImportError, RuntimeError) as e:
            kind = ("data absent" if isinstance(e, FileNotFoundError) else "not installed"
                    if isinstance(e, ImportError) else "unavailable" if isinstance(e, DomainUnavailable)
                    else type(e).__name__)
            skipped[d.name] = f"{kind}: {_one_line(e)}"
            continue
        built.append(ResolvedDomain(d, spec, env.task_source, min(d.tasks, env.task_source.num_tasks)))
    return built, skipped


def suite_dict(suite: Suite, built: Sequence[ResolvedDomain], skipped: Mapping[str, str]) -> dict:
    """A JSON-able description of a resolved suite (written with every result as suite.json): name, path, alpha,
    each built domain's settings, env id, kwargs and task count, the skipped domains with their reasons, and
    "floors": {domain: gaming floor or None} (`runner.spec_floors`)."""
    rows = []
    for r in built:
        row = dataclasses.asdict(r.domain)
        row.update(env_id=r.spec.id, env_kwargs=dict(r.spec.kwargs), num_tasks=r.num_tasks)
        rows.append(json.loads(json.dumps(row, default=str)))
    return {"name": suite.name, "path": suite.path, "alpha": suite.alpha, "domains": rows, "skipped": dict(skipped),
            "floors": spec_floors({r.domain.name: r.spec for r in built})}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."
