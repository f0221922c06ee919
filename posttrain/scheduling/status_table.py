"""The run view (`posttrain status`): per-domain rows from the run's status.json snapshot and / or the episode
archive's counters (the file's form and the columns: docs/scheduling.md)."""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from posttrain.infra.files import atomic_write

STATUS_VERSION = 1
STATUS_FILE = "status.json"
COUNTERS = ("groups", "slots", "cpu_s", "episodes", "scored", "passes", "infra_errors", "retries")
ROW_COLUMNS = ("domain", "weight", "priority", "share_last", "share_run", "quota_last", "quota_run", "episodes",
               "pass_rate", "infra_errors", "retries", "quarantined", "breaker", "level")
ARCHIVE_COLUMNS = ["domain", "step", "task_index", "visit", "try_index", "retry_round", "status", "reward",
                   "env_cost_s"]


def snapshot(step: int, scheduler, levels: Mapping[str, int] | None = None, policy_version: int | None = None
             ) -> dict:
    """The status.json dict of `scheduler` after step `step`, with the curriculum's `levels` and `policy_version`."""
    levels = dict(levels or {})
    domains = {}
    if hasattr(scheduler, "domains"):  # the job scheduler
        for name, d in scheduler.domains.items():
            domains[name] = {"weight": d.weight * d.policy.weight, "priority": d.policy.priority,
                             "max_env_cpu_s": d.policy.max_env_cpu_s, "quarantined": len(d.quarantine),
                             "breaker": d.breaker.state, "level": levels.get(name),
                             "last": {k: d.last[k] for k in COUNTERS}, "run": {k: d.totals[k] for k in COUNTERS}}
        kind = "jobs"
    else:
        for name, p in zip(scheduler.names, scheduler.probs):
            domains[name] = {"weight": float(p), "priority": 0, "level": levels.get(name)}
        kind = "weighted"
    return {"version": STATUS_VERSION, "step": int(step), "steps": int(step) + 1, "scheduler": kind,
            "policy_version": None if policy_version is None else int(policy_version), "domains": domains}


def write_status(workdir, status: Mapping) -> pathlib.Path:
    """Writes `status` to workdir/status.json atomically (temp file, fsync, os.replace)."""
    return atomic_write(pathlib.Path(workdir) / STATUS_FILE, lambda f: json.dump(status, f, sort_keys=True))


def read_status(workdir) -> dict | None:
    """workdir/status.json, or None when there is none; ValueError for a file of a newer version."""
    path = pathlib.Path(workdir) / STATUS_FILE
    if not path.is_file():
        return None
    status = json.loads(path.read_text())
    if int(status.get("version", 0)) > STATUS_VERSION:
        raise ValueError(f"{path}: status version {status.get('version')} is newer than this reader's "
                         f"{STATUS_VERSION}")
    return status


def _counters(table: pa.Table, pass_threshold: float) -> dict[str, dict[str, float]]:
    """{domain: COUNTERS} of archive rows (slots filled in by the caller)."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[str, set] = {}
    cols = {c: table[c].to_pylist() for c in ARCHIVE_COLUMNS}
    for i, domain in enumerate(cols["domain"]):
        c = out.setdefault(domain, dict.fromkeys(COUNTERS, 0))
        infra = cols["status"][i] == "infra_error"
        c["episodes"] += 1
        c["cpu_s"] += cols["env_cost_s"][i] or 0.0
        c["infra_errors"] += int(infra)
        c["retries"] += int((cols["retry_round"][i] or 0) > 0)
        reward = cols["reward"][i]
        if not infra and reward is not None:
            c["scored"] += 1
            c["passes"] += int(reward >= pass_threshold)
        if not cols["retry_round"][i]:
            groups.setdefault(domain, set()).add((cols["step"][i], cols["task_index"][i], cols["visit"][i],
                                                  cols["try_index"][i]))
    slots = sum(len(g) for g in groups.values())
    for domain, c in out.items():
        c["groups"], c["slots"] = len(groups.get(domain, ())), slots
    return out


def archive_stats(table: pa.Table, pass_threshold: float = 1.0) -> dict:
    """The status.json form of archive rows (ARCHIVE_COLUMNS); ValueError naming missing columns."""
    missing = sorted(set(ARCHIVE_COLUMNS) - set(table.column_names))
    if missing:
        raise ValueError(f"archive_stats: the table lacks column(s) {missing}")
    steps = sorted(set(table["step"].to_pylist()))
    if not steps:
        return {"step": None, "steps": 0, "domains": {}}
    last = table.filter(pc.equal(table["step"], steps[-1]))
    run, last_c = _counters(table, pass_threshold), _counters(last, pass_threshold)
    zero = dict.fromkeys(COUNTERS, 0)
    return {"step": steps[-1], "steps": len(steps),
            "domains": {d: {"run": run[d], "last": last_c.get(d, zero)} for d in sorted(run)}}


def _ratio(a, b):
    return None if not b else float(a) / b


def rows(status: Mapping | None, stats: Mapping | None = None) -> list[dict]:
    """One row per domain (ROW_COLUMNS) from a status.json dict and/or `archive_stats`; the snapshot wins."""
    status, stats = status or {}, stats or {}
    sd, ad = status.get("domains", {}), stats.get("domains", {})
    steps = status.get("steps") or stats.get("steps") or 0
    out = []
    for name in sorted(set(sd) | set(ad)):
        d = {**ad.get(name, {}), **sd.get(name, {})}
        last, run = d.get("last"), d.get("run")
        cap = d.get("max_env_cpu_s") or 0.0
        row = dict.fromkeys(ROW_COLUMNS)
        row.update(domain=name, weight=d.get("weight"), priority=d.get("priority"), quarantined=d.get("quarantined"),
                   breaker=d.get("breaker"), level=d.get("level"))
        if last is not None:
            row.update(share_last=_ratio(last["groups"], last["slots"]),
                       quota_last=_ratio(last["cpu_s"], cap) if cap else None)
        if run is not None:
            row.update(share_run=_ratio(run["groups"], run["slots"]),
                       quota_run=_ratio(run["cpu_s"], cap * steps) if cap else None, episodes=run["episodes"],
                       pass_rate=_ratio(run["passes"], run["scored"]), infra_errors=run["infra_errors"],
                       retries=run["retries"])
        out.append(row)
    return out
