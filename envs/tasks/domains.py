"""Domain registry: every reasoning-gym dataset as a training domain ``reasoning_gym/<name>``.

A domain is one dataset behind `envs.tasks.reasoning_gym.ReasoningGymEnv` (env id ``posttrain/ReasoningGym-v0``) with a
default config (the library's defaults; `reasoning_gym.DEFAULT_CONFIGS` for datasets whose defaults do not build).
Configs select domains by name or shell-style pattern (``"reasoning_gym/*"``, ``"reasoning_gym/arith*"``;
`fnmatch.fnmatchcase`), each entry with a weight, a curriculum level and config overrides (`select`).

Each domain's golden check (`check_domain`, `ReasoningGymEnv.golden_check` on a small build) decides whether it
can train: "verified" and "verified_reference_free" domains are selected; "unverified" (no reply known to be
correct) and "failed" (the reference does not score 1 through the env, or a wrong answer scores 1) are left out
unless ``include_unverified=True`` (which admits "unverified" only; "failed" is never selected).
Then the gaming-floor table (`envs.tasks.floors`): a domain whose floor is >= `floors.FLOOR_THRESHOLD` (a reply with
no solution earns that much) or whose golden sample (reference replies of 20 tasks of both splits) fails is
"flagged" and left out unless the config opts in (``allow_flagged=True``, or ``"allow_flagged": True`` in an entry).
Besides reasoning-gym, the env domains of `envs.tasks.probes.ENV_DOMAINS` (arithmetic, gsm8k, humaneval,
python_tool, terminal, agentic/repo_fix) are registered for listings and floors (`registered_domains`).
No JAX; the env specs are plain dicts ``{"id", "weight", "kwargs"}`` (`posttrain.config.env_spec` fields).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envs.tasks import floors, probes
from envs.tasks import reasoning_gym as rg_env
PREFIX = "reasoning_gym/"
CHECK_SIZE = 8  # items built per domain for the golden check (the check reads task 0 and up to 7 more answers)
TRAINABLE = ("verified", "verified_reference_free")


@dataclasses.dataclass(frozen=True)
class DomainCheck:
    """One domain's golden-check outcome: status (`reasoning_gym.GOLDEN_STATUSES`), source of the accepted reply,
    reason when not verified, and the first task's question (a sample for listings)."""

    domain: str
    status: str
    source: str
    reason: str
    sample: str


def all_domains() -> list[str]:
    """Every registered domain name, ``reasoning_gym/<dataset>``, sorted."""
    return [PREFIX + name for name in rg_env.dataset_names()]


def registered_domains() -> list[str]:
    """Every domain of the registry: the reasoning-gym ones (`all_domains`) and the env domains
    (`probes.ENV_DOMAINS`), sorted."""
    return sorted(all_domains() + list(probes.ENV_DOMAINS))


def dataset_of(domain: str) -> str:
    """The reasoning-gym dataset name of `domain`. Raises ValueError when it is not a registered domain."""
    name = domain[len(PREFIX):] if isinstance(domain, str) and domain.startswith(PREFIX) else None
    if name is None or name not in rg_env.dataset_names():
        raise ValueError(f"unknown domain {domain!r}; domains are {PREFIX}<dataset>, e.g. {all_domains()[:3]}")
    return name


def match_domains(patterns: str | Iterable[str]) -> list[str]:
    """Registered domains matching any of `patterns` (names or fnmatch patterns; a str may hold several,
    comma-separated), sorted. Raises ValueError naming a pattern that matches no domain."""
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
    return json.loads(json.dumps(rg_env.DEFAULT_CONFIGS.get(dataset_of(domain), {})))


_CHECKS: dict[tuple, DomainCheck] = {}


def check_domain(domain: str, *, config: Mapping[str, Any] | str | None = None, level: int | None = None,
                 seed: int = 0) -> DomainCheck:
    """Golden check of `domain` with `config`/`level` on a `CHECK_SIZE`-item build (cached per arguments).

    A config or level the library rejects raises ValueError (a config error, not a domain status).
    """
    dataset = dataset_of(domain)
    key = (dataset, json.dumps(rg_env.parse_config(config, dataset), sort_keys=True, default=str), level, seed)
    if key not in _CHECKS:
        env = rg_env.ReasoningGymEnv(dataset=dataset, config=config, level=level, seed=seed, size=CHECK_SIZE,
                                     num_test=1, self_check=False)
        result = env.golden_check()
        sample = env.task_source.get_task(0)["question"]
        _CHECKS[key] = DomainCheck(domain, result.status, result.source, result.reason, sample)
    return _CHECKS[key]


def select(entries: Sequence[Mapping[str, Any]] | str, *, split: str = "train", seed: int = 0, size: int = 10_000,
           num_test: int = 100, include_unverified: bool = False,
           allow_flagged: bool = False) -> tuple[dict[str, dict], dict[str, DomainCheck]]:
    """Env specs for the domains `entries` select, and the matched domains left out (with their checks).

    entries: a pattern string, or a sequence of mappings ``{"pattern": str, "weight"?: float > 0 (default 1.0),
      "level"?: int >= 0 curriculum level (capped at each domain's top level; ignored for a domain without a
      curriculum), "config"?: dict of dataset config overrides}``; every matched domain gets
      the entry's weight; a later entry overrides an earlier one for the domains both match; "allow_flagged"?: bool,
      keep the entry's domains even when the floor table flags them.
    allow_flagged: keep every flagged domain (floor >= `floors.FLOOR_THRESHOLD` or a failing golden sample; the
      floors and golden samples of `floors.assessment`); by default they are left out with status "flagged".
    Returns ({domain: {"id": ENV_ID, "weight": w, "kwargs": {"dataset", "config" (JSON str), "split", "seed",
      "size", "num_test", "level"?}}}, {domain: DomainCheck of a left-out domain}).
    Raises ValueError on an entry without a pattern, an unknown entry key, a non-positive weight, a pattern that
    matches nothing, a bad config or level, or when every matched domain is left out; TypeError on bad types.
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
            top = None if level is None else rg_env.max_level(dataset_of(domain))
            chosen[domain] = {"weight": float(weight), "level": None if top is None else min(level, top),
                              "allow_flagged": bool(entry.get("allow_flagged", allow_flagged)),
                              "config": {**default_config(domain),
                                         **rg_env.parse_config(entry.get("config"), dataset_of(domain))}}
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
        specs[domain] = {"id": rg_env.ENV_ID, "weight": c["weight"], "kwargs": kwargs}
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
    """Golden checks of every domain matching `patterns` (default configs; `probes.ENV_DOMAINS` too), sorted by
    domain."""
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    extra = [d for d in probes.ENV_DOMAINS if any(fnmatch.fnmatchcase(d, p) for p in patterns)]
    rest = [p for p in patterns if any(fnmatch.fnmatchcase(d, p) for d in all_domains())
            or not any(fnmatch.fnmatchcase(d, p) for d in probes.ENV_DOMAINS)]
    checks = [check_domain(d, config=default_config(d)) for d in match_domains(rest)] if rest or not extra else []
    return sorted(checks + [_extra_check(d) for d in extra], key=lambda c: c.domain)


def format_listing(checks: Sequence[DomainCheck], sample_chars: int = 100) -> str:
    """A text table for `posttrain domains`: one line per domain (status, reply source, sample question cut to
    `sample_chars`), the reason under a domain that is not verified, under it the stored floor and golden sample
    (`floors.lookup`) of a flagged domain, and the count per status at the end."""
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
    statuses = list(dict.fromkeys([*rg_env.GOLDEN_STATUSES, *(c.status for c in checks)]))
    counts = {s: sum(c.status == s for c in checks) for s in statuses}
    if flagged:
        lines.append(f"{flagged} flagged by the floor table (posttrain domains --floors; left out of mixes)")
    lines.append(f"{len(checks)} domains: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
