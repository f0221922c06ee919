"""Domain registry: every reasoning-gym dataset as a training domain ``reasoning_gym/<name>``, and its selection.

Configs select domains by name or fnmatch pattern (`select`); a domain trains when its golden check verifies it
and the gaming-floor table (`envs.tasks.floors`) does not flag it. The rules: docs/tasks.md. No JAX.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envs.tasks import floors, probes
from envs.tasks import reasoning_gym
PREFIX = "reasoning_gym/"
CHECK_SIZE = 8  # items built per domain for the golden check (the check reads task 0 and up to 7 more answers)
TRAINABLE = ("verified", "verified_reference_free")


@dataclasses.dataclass(frozen=True)
class DomainCheck:
    """One domain's golden-check outcome (status: `reasoning_gym.GOLDEN_STATUSES`; sample: task 0's question)."""

    domain: str
    status: str
    source: str
    reason: str
    sample: str


def all_domains() -> list[str]:
    """Every registered domain name, ``reasoning_gym/<dataset>``, sorted."""
    return [PREFIX + name for name in reasoning_gym.dataset_names()]


def registered_domains() -> list[str]:
    """Every domain of the registry, sorted: `all_domains` and the env domains (`probes.ENV_DOMAINS`)."""
    return sorted(all_domains() + list(probes.ENV_DOMAINS))


def dataset_of(domain: str) -> str:
    """The reasoning-gym dataset name of `domain`. Raises ValueError when it is not a registered domain."""
    name = domain[len(PREFIX):] if isinstance(domain, str) and domain.startswith(PREFIX) else None
    if name is None or name not in reasoning_gym.dataset_names():
        raise ValueError(f"unknown domain {domain!r}; domains are {PREFIX}<dataset>, e.g. {all_domains()[:3]}")
    return name


def match_domains(patterns: str | Iterable[str]) -> list[str]:
    """Registered domains matching any of `patterns` (fnmatch; a str may be comma-separated), sorted.

    Raises ValueError naming a pattern that matches no domain."""
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    patterns = list(patterns)
    if not patterns:
        raise ValueError("match_domains: no pattern given")
    domains, out = all_domains(), set()
    for pattern in patterns:
        hits = [d for d in domains if fnmatch.fnmatchcase(d, pattern)]
        if not hits:
            raise ValueError(f"domain pattern {pattern!r} matches no domain (names look like {domains[0]!r})")
        out.update(hits)
    return sorted(out)


def default_config(domain: str) -> dict:
    """The default dataset config of `domain` (a copy; empty: the library's own defaults)."""
    return json.loads(json.dumps(reasoning_gym.DEFAULT_CONFIGS.get(dataset_of(domain), {})))


_CHECKS: dict[tuple, DomainCheck] = {}


def check_domain(domain: str, *, config: Mapping[str, Any] | str | None = None, level: int | None = None,
                 seed: int = 0) -> DomainCheck:
    """Golden check of `domain` with `config`/`level` on a `CHECK_SIZE`-item build, cached per arguments.

    Raises ValueError on a config or level the library rejects (a config error, not a domain status)."""
    dataset = dataset_of(domain)
    key = (dataset, json.dumps(reasoning_gym.parse_config(config, dataset), sort_keys=True, default=str), level, seed)
    if key not in _CHECKS:
        env = reasoning_gym.ReasoningGymEnv(dataset=dataset, config=config, level=level, seed=seed, size=CHECK_SIZE,
                                     num_test=1, self_check=False)
        result = env.golden_check()
        sample = env.task_source.get_task(0)["question"]
        _CHECKS[key] = DomainCheck(domain, result.status, result.source, result.reason, sample)
    return _CHECKS[key]


def select(entries: Sequence[Mapping[str, Any]] | str, *, split: str = "train", seed: int = 0, size: int = 10_000,
           num_test: int = 100, include_unverified: bool = False,
           allow_flagged: bool = False) -> tuple[dict[str, dict], dict[str, DomainCheck]]:
    """Env specs for the domains `entries` select, and the matched domains left out, with their checks.

    Args:
      entries: a pattern string, or mappings ``{"pattern", "weight"? (> 0, default 1.0), "level"? (curriculum
        level, capped at the domain's top), "config"? (overrides), "allow_flagged"?}``; a later entry overrides an
        earlier one for the domains both match.
      include_unverified: also train "unverified" domains ("failed" ones never train).
      allow_flagged: keep the domains `floors.flag_reason` flags (by default left out with status "flagged").
    Returns ({domain: {"id", "weight", "kwargs"}} (`posttrain.config.env_spec` fields), {domain: left-out check}).
    Raises ValueError on a bad entry, pattern, config or level, or when every domain is left out; TypeError on types.
    """
    if isinstance(entries, str):
        entries = [{"pattern": entries}]
    chosen: dict[str, dict] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise TypeError(f"domain entry {i} must be a mapping with a 'pattern', got {type(entry).__name__}")
        unknown = sorted(set(entry) - {"pattern", "weight", "level", "config", "allow_flagged"})
        if unknown or "pattern" not in entry:
            raise ValueError(f"domain entry {i}: keys must be pattern (required), weight, level, config, "
                             f"allow_flagged; "
                             f"got {sorted(entry)}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"domain entry {i} ({entry['pattern']!r}): weight must be a number > 0, got {weight!r}")
        level = entry.get("level")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
            raise ValueError(f"domain entry {i} ({entry['pattern']!r}): level must be an int >= 0, got {level!r}")
        for domain in match_domains(entry["pattern"]):
            top = None if level is None else reasoning_gym.max_level(dataset_of(domain))
            chosen[domain] = {"weight": float(weight), "level": None if top is None else min(level, top),
                              "allow_flagged": bool(entry.get("allow_flagged", allow_flagged)),
                              "config": {**default_config(domain),
                                         **reasoning_gym.parse_config(entry.get("config"), dataset_of(domain))}}
    specs, left_out = {}, {}
    for domain, c in chosen.items():
        check = check_domain(domain, config=c["config"], level=c["level"], seed=seed)
        if check.status not in TRAINABLE and not (include_unverified and check.status == "unverified"):
            left_out[domain] = check
            continue
        flag = "" if c["allow_flagged"] else floors.flag_reason(
            floors.assessment(domain, c["config"], level=c["level"]), unverified=check.status != "unverified")
        if flag:
            left_out[domain] = DomainCheck(domain, "flagged", check.source, flag, check.sample)
            continue
        kwargs = {"dataset": dataset_of(domain), "config": json.dumps(c["config"], sort_keys=True), "split": split,
                  "seed": seed, "size": size, "num_test": num_test}
        if c["level"] is not None:
            kwargs["level"] = c["level"]
        if check.status == "unverified":
            kwargs["allow_unverified"] = True
        specs[domain] = {"id": reasoning_gym.ENV_ID, "weight": c["weight"], "kwargs": kwargs}
    if not specs:
        raise ValueError(f"no trainable domain among {sorted(chosen)}: left out {_describe(left_out)}")
    return specs, left_out


def _describe(left_out: Mapping[str, DomainCheck]) -> str:
    return "; ".join(f"{d} ({c.status}: {c.reason})" for d, c in sorted(left_out.items())) or "none"


def _extra_check(domain: str) -> DomainCheck:
    """The construction-time golden check of an env domain (`probes.ENV_DOMAINS`): its reference function, or
    building the env (its self-check): "verified", "failed" (RuntimeError) or "skipped" (data/package absent)."""
    d = probes.ENV_DOMAINS[domain]
    if ":" in d.reference:
        module, function = d.reference.split(":")
        return DomainCheck(domain, *getattr(importlib.import_module(module), function)())
    import gymnasium

    import envs  # noqa: F401  (registers the ids)

    try:
        env = gymnasium.make(d.env_id, **d.kwargs).unwrapped
    except (OSError, ImportError) as exc:
        return DomainCheck(domain, "skipped", d.reference, f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:200],
                           d.env_id)
    except RuntimeError as exc:
        return DomainCheck(domain, "failed", d.reference, " ".join(str(exc).split())[:200], d.env_id)
    sample = f"{d.env_id}: {env.task_source.num_tasks} {env.task_source.split} tasks"
    env.close()
    return DomainCheck(domain, "verified", d.reference, "", sample)


def summary(patterns: str | Iterable[str] = PREFIX + "*") -> list[DomainCheck]:
    """Golden checks of every domain matching `patterns` (default configs; env domains included), sorted."""
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    extra = [d for d in probes.ENV_DOMAINS if any(fnmatch.fnmatchcase(d, p) for p in patterns)]
    rest = [p for p in patterns if any(fnmatch.fnmatchcase(d, p) for d in all_domains())
            or not any(fnmatch.fnmatchcase(d, p) for d in probes.ENV_DOMAINS)]
    checks = [check_domain(d, config=default_config(d)) for d in match_domains(rest)] if rest or not extra else []
    return sorted(checks + [_extra_check(d) for d in extra], key=lambda c: c.domain)


def format_listing(checks: Sequence[DomainCheck], sample_chars: int = 100) -> str:
    """The `posttrain domains` table: a line per domain, its reason and floor-table flag under it, counts last."""
    lines, table, flagged = [], floors.load_table(), 0
    for c in checks:
        sample = " ".join(c.sample.split())
        sample = sample if len(sample) <= sample_chars else sample[:sample_chars - 3] + "..."
        lines.append(f"{c.domain:<40} {c.status:<24} {c.source:<32} {sample}")
        if c.reason:
            lines.append(f"{'':<40} ^ {c.reason[:200]}")
        stored = (table.get("domains") or {}).get(c.domain)
        flag = floors.flag_reason(floors.row_assessment(c.domain, stored)) if stored else ""
        if flag:
            flagged += 1
            lines.append(f"{'':<40} ^ flagged (floor table): {flag[:200]}")
    statuses = list(dict.fromkeys([*reasoning_gym.GOLDEN_STATUSES, *(c.status for c in checks)]))
    counts = {s: sum(c.status == s for c in checks) for s in statuses}
    if flagged:
        lines.append(f"{flagged} flagged by the floor table (posttrain domains --floors; left out of mixes)")
    lines.append(f"{len(checks)} domains: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
