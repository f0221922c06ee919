"""The table of gaming floors and golden samples (`envs/tasks/domain_floors.json`), its lookup and the flag rule.

A row answers only when the installed reasoning-gym version and its config agree; otherwise `assessment`
computes it in-process, so a stale table never decides (docs/tasks.md). No JAX.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from envs.tasks import probes
from envs.tasks import reasoning_gym
from envs.tasks.task_file import ENV_ID as TASK_FILE_ID

TABLE_PATH = pathlib.Path(__file__).with_name("domain_floors.json")
SCHEMA_VERSION = 1
_TASK_FILE_FLOORS: dict[str, float | None] = {}  # floors of task files measured in this process, by their kwargs
FLOOR_THRESHOLD = 0.2  # the floor from which a domain is flagged (mean reward in [0, 1] of the best probe)
PROBE_TASKS = 20  # tasks per split probed and golden-checked
_COMPUTED: dict[tuple, probes.Assessment] = {}


def library_version() -> str:
    """The installed reasoning-gym version (the table's key)."""
    from importlib.metadata import version

    return version("reasoning-gym")


def config_key(config: Mapping[str, Any] | str | None, dataset: str = "?") -> str:
    """A dataset config as the table's key: sorted JSON of `rg_env.parse_config(config)`."""
    return json.dumps(reasoning_gym.parse_config(config, dataset), sort_keys=True, default=str)


def load_table(path: str | pathlib.Path = TABLE_PATH) -> dict:
    """The table at `path`, {} when there is none (read again only when the file changes).

    Raises ValueError on another schema version or a malformed file."""
    path = pathlib.Path(path)
    if not path.is_file():
        return {}
    return _read_table(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_table(path_str: str, mtime_ns: int) -> dict:
    path = pathlib.Path(path_str)
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(table, dict) or table.get("schema_version") != SCHEMA_VERSION or "domains" not in table:
        raise ValueError(f"{path}: expected schema_version {SCHEMA_VERSION} with 'domains', got "
                         f"{table.get('schema_version') if isinstance(table, dict) else type(table).__name__}")
    return table


def table_dict(assessments: Iterable[probes.Assessment]) -> dict:
    """The JSON-able table of `assessments` (sorted by domain; probe means rounded to 4 places)."""
    rows = {}
    for a in sorted(assessments, key=lambda a: a.domain):
        row = dataclasses.asdict(a)
        row.pop("domain")
        row["probes"] = {k: round(v, 4) for k, v in sorted(a.probes.items(), key=lambda kv: -kv[1])[:5]}
        row["floor"] = None if a.floor is None else round(a.floor, 4)
        rows[a.domain] = row
    return {"schema_version": SCHEMA_VERSION, "reasoning_gym": library_version(), "probe_tasks": PROBE_TASKS,
            "floor_threshold": FLOOR_THRESHOLD, "domains": rows}


def write_table(assessments: Iterable[probes.Assessment], path: str | pathlib.Path = TABLE_PATH) -> pathlib.Path:
    """Write the rows of `assessments` into the table at `path`, one row per line; return the path.

    A diff shows the rows that changed; the rows of other domains stay when the table is of the same reasoning-gym
    version (`--pattern` recomputes some rows, never drops the rest)."""
    table = table_dict(assessments)
    rows = table.pop("domains")
    old = _read_table(str(path), pathlib.Path(path).stat().st_mtime_ns) if pathlib.Path(path).is_file() else {}
    if old.get("reasoning_gym") == table["reasoning_gym"]:  # `--pattern` recomputes some rows, never drops the rest
        rows = dict(sorted({**(old.get("domains") or {}), **rows}.items()))
    head = json.dumps(table)[:-1]
    body = ",\n".join(f"  {json.dumps(d)}: {json.dumps(r, sort_keys=True)}" for d, r in rows.items())
    path = pathlib.Path(path)
    path.write_text(f"{head}, \"domains\": {{\n{body}\n}}}}\n")
    return path


def row_assessment(domain: str, row: Mapping[str, Any]) -> probes.Assessment:
    """The `probes.Assessment` a table row stores."""
    fields = {f.name for f in dataclasses.fields(probes.Assessment)} - {"domain"}
    return probes.Assessment(domain=domain, **{k: row[k] for k in fields if k in row})


def lookup(domain: str, config: str, table: Mapping | None = None) -> probes.Assessment | None:
    """The stored assessment of `domain` with `config` (a `config_key`), or None.

    None also when the row holds another config or was computed with another reasoning-gym version."""
    table = load_table() if table is None else table
    row = (table.get("domains") or {}).get(domain)
    if row is None or row.get("config") != config:
        return None
    if domain.startswith(probes.RG_PREFIX) and table.get("reasoning_gym") != library_version():
        return None
    return row_assessment(domain, row)


def assess(domain: str, config: Mapping[str, Any] | str | None = None, *, level: int | None = None,
           tasks: int = PROBE_TASKS) -> probes.Assessment:
    """A fresh assessment of a reasoning-gym domain (with `config`/`level`) or an `ENV_DOMAINS` name.

    A domain the stored table holds (same config, same library version) is sampled on the row's number of tasks
    without a time budget, so the fresh floor equals the stored one; others within `probes`' time budget. Raises
    ValueError for an unknown domain or a bad config."""
    if domain.startswith(probes.RG_PREFIX):
        parsed = reasoning_gym.parse_config(config, domain)
        stored = lookup(domain, config_key(parsed, domain)) if level is None else None
        if stored is not None and stored.sampled:  # the stored row's task count: the same tasks, the same floor
            return probes.assess_reasoning_gym(domain, parsed, tasks=stored.sampled, level=level, budget_s=None)
        return probes.assess_reasoning_gym(domain, parsed, tasks=tasks, level=level)
    if domain in probes.ENV_DOMAINS:
        return probes.assess_env_domain(domain, tasks=tasks)
    raise ValueError(f"unknown domain {domain!r}: reasoning_gym/<dataset> or one of {sorted(probes.ENV_DOMAINS)}")


def assessment(domain: str, config: Mapping[str, Any] | str | None = None, *,
               level: int | None = None) -> probes.Assessment:
    """The table's row for (`domain`, `config`) at level None, else a computed one (cached in this process)."""
    key_config = (config_key(config, domain) if domain.startswith(probes.RG_PREFIX)
                  else json.dumps(dict(probes.ENV_DOMAINS[domain].kwargs), sort_keys=True)
                  if domain in probes.ENV_DOMAINS else "")
    if level is None:
        stored = lookup(domain, key_config)
        if stored is not None:
            return stored
    key = (domain, key_config, level)
    if key not in _COMPUTED:
        _COMPUTED[key] = assess(domain, config, level=level)
    return _COMPUTED[key]


def flag_reason(a: probes.Assessment, threshold: float = FLOOR_THRESHOLD, *, unverified: bool = True) -> str:
    """Why `a`'s domain is flagged ("" when not): floor >= `threshold`, or a golden sample "failed" (or "unverified").

    A policy can learn a high floor instead of the task. "skipped" domains (data absent) are never flagged."""
    reasons = []
    if a.floor is not None and a.floor >= threshold:
        reasons.append(f"floor {a.floor:.2f} >= {threshold:g} ({a.probe})")
    if a.golden == "failed" or (unverified and a.golden == "unverified"):
        reasons.append(f"golden sample {a.golden}" + (f": {a.reason}" if a.reason else ""))
    return "; ".join(reasons)


def floor_by_env(env_id: str, kwargs: Mapping[str, Any]) -> float | None:
    """The floor of the domain an env spec builds, or None outside the registry or for a skipped domain.

    A ReasoningGym-v0 spec: its (dataset, config, level); another env: its `ENV_DOMAINS` row (default kwargs)."""
    if env_id == reasoning_gym.ENV_ID:
        return assessment(probes.RG_PREFIX + kwargs["dataset"], kwargs.get("config"), level=kwargs.get("level")).floor
    if env_id == TASK_FILE_ID:
        key = json.dumps(dict(kwargs), sort_keys=True, default=str)
        if key not in _TASK_FILE_FLOORS:
            _TASK_FILE_FLOORS[key] = probes.assess_task_file(kwargs).floor
        return _TASK_FILE_FLOORS[key]
    names = [name for name, d in probes.ENV_DOMAINS.items() if d.env_id == env_id]
    return assessment(names[0]).floor if names else None


def assess_all(domains: Iterable[str], *, tasks: int = PROBE_TASKS, progress=None) -> list[probes.Assessment]:
    """Fresh assessments of `domains` with their default configs, in order; `progress(a)` is called after each.

    A reasoning-gym dataset whose default config cannot be built gives a "skipped" row with the reason."""
    out = []
    for domain in domains:
        config = reasoning_gym.DEFAULT_CONFIGS.get(domain.removeprefix(probes.RG_PREFIX), {})
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # some scorers print their parse errors
                a = assess(domain, config, tasks=tasks)
        except ValueError as exc:
            a = probes.Assessment(domain, config_key(config), None, "", {}, "skipped", 0, 0,
                                  " ".join(str(exc).split())[:200], {})
        out.append(a)
        if progress is not None:
            progress(a)
    return out


def format_floors(assessments: Iterable[probes.Assessment], threshold: float = FLOOR_THRESHOLD) -> str:
    """The `posttrain domains --floors` table: per domain floor, best probe, golden sample and flag; counts last."""
    rows = list(assessments)
    lines = [f"{'domain':<40} {'floor':>6} {'best probe':<24} {'golden':<10} {'ok/checked':>10}  tasks / flag"]
    for a in rows:
        floor = "-" if a.floor is None else f"{a.floor:.3f}"
        counts = ", ".join(f"{s} {'procedural' if n is None else n}" for s, n in a.num_tasks.items())
        flag = flag_reason(a, threshold)
        lines.append(f"{a.domain:<40} {floor:>6} {a.probe[:24]:<24} {a.golden:<10} "
                     f"{a.golden_checked - a.golden_failures:>4}/{a.golden_checked:<5}  {counts}; floor on {a.sampled}")
        if flag or a.golden == "skipped":
            lines.append(f"{'':<40} ^ {'FLAGGED: ' + flag if flag else 'skipped: ' + a.reason}"[:240])
    by_floor = sum(a.floor is not None and a.floor >= threshold for a in rows)
    status = {s: sum(a.golden == s for a in rows) for s in probes.GOLDEN_SAMPLE_STATUSES}
    flagged = sum(bool(flag_reason(a, threshold)) for a in rows)
    lines.append(f"{len(rows)} domains: {flagged} flagged ({by_floor} by floor >= {threshold:g}, {status['failed']} "
                 f"failing golden sample, {status['unverified']} unverified); {status['skipped']} skipped")
    return "\n".join(lines)
