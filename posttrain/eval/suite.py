"""Evaluation suites: named domains grouped into capability areas, read from `configs/eval/<name>.py`.

The file format and how domains are built or skipped: docs/evaluation.md. No JAX here.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.util
import json
import pathlib
import sys
import traceback
from typing import Any, Mapping, Sequence

from posttrain.errors import ConfigError
from posttrain.eval.runner import FORMATS, SCORERS, spec_floors
from posttrain.rollout.env_side import TASK_FILE_ID, EnvSpec, EnvSpecError, task_sources

DOMAIN_KEYS = ("env", "path", "kwargs", "config", "split", "tasks", "n", "k", "temperature", "max_new_tokens",
               "max_turns", "scorer", "format", "trained", "min_positions")
TEMPLATE_MARGIN = 64  # positions a chat template and system prompt add around a prompt of kwargs["target_tokens"]
REGISTRY_PREFIXES = ("reasoning_gym/",)  # domain names built through envs.tasks.domains
FIRST_PARTY = ("envs", "posttrain")  # a module of these missing is a broken install, never a skipped domain


class DomainUnavailable(RuntimeError):
    """A registry domain whose golden check does not pass: it is skipped, not evaluated."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteDomain:
    """One domain of a suite (the settings: docs/evaluation.md); ks: the pass@k values (k >= 2).

    min_positions: the model positions its episodes need (0: `positions_needed` derives them, or none)."""

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
    min_positions: int = 0

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
    """The suite `get_suite()` of the Python file `path` defines; FileNotFoundError, or ValueError naming the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--suite={path}: no such file (suites live in configs/eval/*.py)")
    spec = importlib.util.spec_from_file_location(f"suite_{path.stem}", path)
    if spec is None:
        raise ValueError(f"{path}: a suite is a Python file (.py) defining get_suite() -> dict")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        raw = module.get_suite() if hasattr(module, "get_suite") else None
    except Exception as e:  # noqa: BLE001 - the user's file: its error in one line, where it was raised
        raise ValueError(f"{path}: loading the suite raised {_error_line(e)}") from e
    if not hasattr(module, "get_suite"):
        raise ValueError(f"{path}: a suite file defines get_suite() -> dict")
    return parse_suite(raw, str(path))


def parse_suite(raw: Mapping, path: str = "<suite>") -> Suite:
    """A validated Suite from the dict a suite file returns; ValueError naming `path`, the domain and the key."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: get_suite() returns a dict with keys name, alpha, defaults, areas; got "
                         f"{type(raw).__name__}")
    unknown = sorted(set(raw) - {"name", "alpha", "defaults", "areas"})
    if unknown or "areas" not in raw or not raw["areas"]:
        raise ValueError(f"{path}: a suite has keys name, alpha, defaults, areas (non-empty); got {sorted(raw)}")
    title, alpha, defaults = raw.get("name", pathlib.Path(path).stem), raw.get("alpha", 0.05), raw.get("defaults", {})
    if not (isinstance(title, str) and title):
        raise ValueError(f"{path}: name must be a non-empty string, got {title!r}")
    if not (_is_number(alpha) and 0.0 < alpha < 1.0):
        raise ValueError(f"{path}: alpha must be in (0, 1), got {alpha!r}")
    if not isinstance(defaults, Mapping) or not isinstance(raw["areas"], Mapping):
        raise ValueError(f"{path}: defaults (domain settings) and areas ({{area: {{'domains': {{...}}}}}}) are dicts, "
                         f"got defaults={type(defaults).__name__}, areas={type(raw['areas']).__name__}")
    domains: list[SuiteDomain] = []
    for area, block in raw["areas"].items():
        if (not isinstance(block, Mapping) or set(block) - {"trained", "domains"} or not block.get("domains")
                or not isinstance(block["domains"], Mapping) or not isinstance(block.get("trained", False), bool)):
            raise ValueError(f"{path}: area {area!r} is a dict with 'domains' (a non-empty dict) and optional "
                             "'trained' (a bool)")
        for name, entry in block["domains"].items():
            if not (isinstance(name, str) and name) or not isinstance(entry, (Mapping, type(None))):
                raise ValueError(f"{path}: area {area!r}: domain {name!r}: domains are named by non-empty strings, "
                                 f"each with a dict of settings (keys {list(DOMAIN_KEYS)}), got {type(entry).__name__}")
            merged = {"trained": block.get("trained", False), **defaults, **dict(entry or {})}
            try:
                expanded_names = _expand(name, merged)
            except ValueError as e:
                raise ValueError(f"{path}: domain {name!r}: {_one_line(e, limit=None)}") from None
            for expanded in expanded_names:
                domains.append(_domain(expanded, area, merged, path))
    names = [d.name for d in domains]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: domains appear more than once: {repeated}")
    return Suite(title, path, alpha, tuple(domains))


def _expand(name: str, entry: Mapping) -> list[str]:
    """The registry domains a name without "env" stands for (a pattern may match several); [name] otherwise."""
    if entry.get("env") or not any(ch in name for ch in "*?["):
        return [name]
    from envs.tasks import domains as domains_lib

    return domains_lib.match_domains(name)


def _domain(name: str, area: str, entry: Mapping, path: str) -> SuiteDomain:
    """The SuiteDomain of one (expanded) entry. Raises ValueError naming `path`, the domain and every bad key."""
    where = f"{path}: domain {name!r}"
    unknown = sorted(set(entry) - set(DOMAIN_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {list(DOMAIN_KEYS)}")
    wrong = [f"{key}={entry[key]!r} must be {what}" for key, (ok, what) in _TYPES.items()
             if key in entry and not ok(entry[key])]
    if wrong:
        raise ValueError(f"{where}: " + "; ".join(wrong))
    if entry.get("path"):  # a task file (a private set): the task-file env reads it
        if entry.get("env") not in (None, "", TASK_FILE_ID) or "path" in entry.get("kwargs", {}):
            raise ValueError(f"{where}: path={entry['path']!r} names a task file ({TASK_FILE_ID}); give it alone, "
                             "without 'env' or kwargs['path']")
        kwargs = {"unsplit": "test", **dict(entry.get("kwargs", {})), "path": entry["path"]}  # unsplit: all rows
        entry = {**entry, "env": TASK_FILE_ID, "kwargs": kwargs}
    if not entry.get("env") and not name.startswith(REGISTRY_PREFIXES):
        raise ValueError(f"{where}: give 'env' (a gymnasium id), 'path' (a task file) or name a registry domain "
                         f"({REGISTRY_PREFIXES})")
    fields = {k: entry[k] for k in DOMAIN_KEYS if k in entry and k not in ("k", "path")}
    d = SuiteDomain(name=name, area=str(area), ks=_ks(entry.get("k", ())), **fields)
    _check_domain(d, where)
    return d


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _ks(value) -> tuple[int, ...] | None:
    """The pass@k values (k >= 2, sorted) of a domain's k, an int or list of ints >= 1; None for anything else."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(_is_int(k) and k >= 1 for k in values):
        return None
    return tuple(sorted(set(values) - {1}))


# the settings whose type `_domain` checks: key -> (accepts, what it must be)
_TYPES = {
    **{key: (lambda v: _is_int(v) and v >= 1, "an int >= 1")
       for key in ("tasks", "n", "max_new_tokens", "max_turns", "min_positions")},
    "env": (lambda v: isinstance(v, str), "a gymnasium id string, e.g. 'posttrain/Arithmetic-v0' or 'my_envs:MyEnv-v0'"),
    "path": (lambda v: isinstance(v, str) and bool(v.strip()), "a task file path (JSONL, CSV, Parquet or tfds:NAME)"),
    "kwargs": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
               "a dict of env constructor kwargs, e.g. {'digits': 2}"),
    "config": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
               "a dict of dataset config overrides"),
    "split": (lambda v: v is None or isinstance(v, str), "a split name (str) or None"),
    "k": (lambda v: _ks(v) is not None, "an int >= 1 or a list of them (the pass@k values, e.g. 4 or [2, 4])"),
    "temperature": (_is_number, "a number >= 0"),
    "scorer": (lambda v: isinstance(v, str), f"a str, one of {sorted(SCORERS)}"),
    "format": (lambda v: isinstance(v, str), f"a str, one of {sorted(FORMATS)}"),
    "trained": (lambda v: isinstance(v, bool), "a bool"),
}


def _check_domain(d: SuiteDomain, where: str) -> None:
    problems = []
    if d.temperature < 0:
        problems.append(f"temperature={d.temperature!r} must be >= 0")
    elif d.greedy and (d.n != 1 or d.ks):
        problems.append(f"temperature 0 (greedy) has one sample per task and no pass@k, got n={d.n}, k={list(d.ks)}")
    short = [k for k in d.ks if d.n < k]
    if short:
        problems.append(f"pass@k needs n >= k samples per task (Chen et al. 2021's unbiased estimator), got n={d.n} "
                        f"for k={short}")
    if d.scorer not in SCORERS:
        problems.append(f"scorer={d.scorer!r} is not one of {sorted(SCORERS)}")
    if d.format not in FORMATS:
        problems.append(f"format={d.format!r} is not one of {sorted(FORMATS)}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def select(suite: Suite, *, limit: int | None = None, domains: str | Sequence[str] | None = None) -> Suite:
    """The suite cut to the domains matching `domains` (fnmatch patterns) and `limit` tasks; ValueError if none."""
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


def positions_needed(d: SuiteDomain) -> int | None:
    """The model positions a domain's episodes need; None when the domain does not say.

    Its `min_positions`, else (a long-context env) kwargs["target_tokens"] + max_new_tokens x max_turns +
    TEMPLATE_MARGIN."""
    if d.min_positions:
        return d.min_positions
    target = d.kwargs.get("target_tokens")
    return target + d.max_new_tokens * d.max_turns + TEMPLATE_MARGIN if _is_int(target) else None


def fit_positions(suite: Suite, positions: int) -> tuple[Suite, dict[str, str]]:
    """(`suite` without the domains needing more than `positions`, {domain left out: why}), in suite order."""
    kept, skipped = [], {}
    for d in suite.domains:
        need = positions_needed(d)
        if need is None or need <= positions:
            kept.append(d)
        elif d.min_positions:
            skipped[d.name] = f"too long: needs {need:,} positions (min_positions), the model has {positions:,}"
        else:
            skipped[d.name] = (f"too long: {d.kwargs['target_tokens']:,}-token prompts exceed the model's "
                               f"{positions:,} positions ({need:,} with the reply and chat template)")
    return dataclasses.replace(suite, domains=tuple(kept)), skipped


def env_spec_of(d: SuiteDomain) -> EnvSpec:
    """The EnvSpec of a domain, or the registry's (`envs.tasks.domains.select`); DomainUnavailable if it fails."""
    if d.env:
        kwargs = dict(d.kwargs) if d.split is None else {**dict(d.kwargs), "split": d.split}
        return EnvSpec(id=d.env, kwargs=kwargs)
    from envs.tasks import domains as domains_lib

    from envs.tasks import floors

    config = {**domains_lib.default_config(d.name), **dict(d.config)}
    check = domains_lib.check_domain(d.name, config=config)
    if check.status not in domains_lib.TRAINABLE:
        raise DomainUnavailable(f"golden check {check.status}: {check.reason}")
    sampled = floors.assessment(d.name, config)
    if sampled.golden == "failed":
        raise DomainUnavailable(f"golden sample failed: {sampled.reason}")
    entry = {"pattern": d.name, "allow_flagged": True, **({"config": dict(d.config)} if d.config else {})}
    specs, _ = domains_lib.select([entry], split=d.split or "test", num_test=d.tasks, size=max(d.tasks, 1000))
    spec = specs[d.name]
    return EnvSpec(id=spec["id"], kwargs={**spec["kwargs"], **dict(d.kwargs)})


def resolve(suite: Suite) -> tuple[list[ResolvedDomain], dict[str, str]]:
    """(the domains that build, in suite order; {skipped domain: reason}); ConfigError for what is not skippable."""
    import envs

    built, skipped = [], {}
    for d in suite.domains:
        builtin = not d.env or d.env in envs.ENTRY_POINTS
        try:
            if not builtin:
                _import_env_module(d.env)
            spec = env_spec_of(d)
            source = task_sources({d.name: spec})[d.name][2]
        except Exception as e:  # noqa: BLE001 - every failure to build is this domain's: skipped or named
            cause = e.__cause__ if isinstance(e, EnvSpecError) and e.__cause__ is not None else e
            reason = _skip_reason(cause) if builtin else None
            if reason is None:
                message = (str(e).removeprefix(f"{e.name}: ") if isinstance(e, EnvSpecError) else str(e)
                           if isinstance(e, ValueError) else _error_line(e, where=False))
                raise ConfigError(f"{suite.path}: domain {d.name!r}: {_one_line(message, limit=None)}") from e
            skipped[d.name] = reason
            continue
        built.append(ResolvedDomain(d, spec, source, min(d.tasks, source.num_tasks)))
    return built, skipped


def suite_prompts(suite: Suite) -> dict[str, list[tuple[str, str]]]:
    """The prompts of a suite's tasks, what a training task file must not repeat: {"<suite>/<domain>": [(id, text)]}.

    Every task of the domains that build: its "question" or "prompt" field, else the env's first observation.
    Raises ConfigError as `resolve`."""
    import gymnasium

    out = {}
    for r in resolve(suite)[0]:
        env = None
        rows = []
        for i in range(r.source.num_tasks):
            task = r.source.get_task(i)
            text = task.get("question") if isinstance(task.get("question"), str) else task.get("prompt")
            if not isinstance(text, str):
                env = env or gymnasium.make(r.spec.id, **dict(r.spec.kwargs)).unwrapped
                text = env.first_observation(env.validate_task(dict(task)))
            rows.append((str(task.get("id", i)), text))
        out[f"{suite.name}/{r.domain.name}"] = rows
    return out


def _import_env_module(env_id: str) -> None:
    """Imports the module of a `module:Env-v0` id as gymnasium.make would; ValueError naming it when that fails."""
    if ":" not in env_id:
        return
    module = env_id.split(":")[0]
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module: its error in one line, where it was raised
        if isinstance(e, ModuleNotFoundError) and e.name and (module + ".").startswith(e.name + "."):
            raise ValueError(f"env {env_id!r}: no module named {e.name!r} (gymnasium imports {module!r} to "
                             f"register the id: {e.name.replace('.', '/')}.py must be on sys.path: the current "
                             "directory for the posttrain command and python -m, or a folder on PYTHONPATH)") from e
        raise ValueError(f"env {env_id!r}: importing module {module!r} raised {_error_line(e)}") from e


def _skip_reason(e: BaseException) -> str | None:
    """Why a built-in domain failing with `e` is skipped (only what this machine lacks), or None to report `e`."""
    if isinstance(e, DomainUnavailable):
        return f"unavailable: {_one_line(e)}"
    if isinstance(e, ImportError):
        return f"not installed: {_one_line(e)}" if _missing_package(e) else None
    if isinstance(e, FileNotFoundError):
        return f"data absent: {_one_line(e)}"
    if isinstance(e, (OSError, RuntimeError)):
        return f"{type(e).__name__}: {_one_line(e)}"
    return None


def _missing_package(e: BaseException) -> str | None:
    """The third-party package an ImportError chain reports missing (None for posttrain / envs: a broken install)."""
    seen = []
    while isinstance(e, ImportError) and all(e is not x for x in seen):
        if isinstance(e, ModuleNotFoundError) and e.name:
            top = e.name.partition(".")[0]
            return None if top in FIRST_PARTY else top
        seen.append(e)
        e = e.__cause__ or e.__context__
    return None


def suite_dict(suite: Suite, built: Sequence[ResolvedDomain], skipped: Mapping[str, str]) -> dict:
    """A JSON-able description of a resolved suite (suite.json): settings, built and skipped domains, gaming floors."""
    rows = []
    for r in built:
        row = dataclasses.asdict(r.domain)
        if not row["min_positions"]:  # the rows of suites written before the field existed stay equal
            del row["min_positions"]
        row.update(env_id=r.spec.id, env_kwargs=dict(r.spec.kwargs), num_tasks=r.num_tasks)
        rows.append(json.loads(json.dumps(row, default=str)))
    return {"name": suite.name, "path": suite.path, "alpha": suite.alpha, "domains": rows, "skipped": dict(skipped),
            "floors": spec_floors({r.domain.name: r.spec for r in built})}


def _one_line(e: BaseException | str, limit: int | None = 200) -> str:
    text = " ".join(str(e).split())
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def _error_line(e: BaseException, where: bool = True) -> str:
    """"Type: message" of `e` on one line; `where`: with the file:line of the innermost user frame that raised it."""
    text = f"{type(e).__name__}: {_one_line(e, limit=None)}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    frames = [f for f in frames if not f.filename.startswith(installed)] or frames
    if where and frames and not isinstance(e, SyntaxError):
        text += f" ({frames[-1].filename}:{frames[-1].lineno})"
    return text
