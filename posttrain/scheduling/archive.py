"""The episode archive: one Parquet row per sample attempt under `workdir/archive/`, written atomically per step.

Layout: `archive/step_00000012.parquet` holds every sample attempt the rollout phase ran for batch 12 (trained or
not: `in_batch`). Batches count from 0 as the learner's policy version when it trains them, so a row's staleness is
`step - policy_version` and batch s is trained by the update metrics.jsonl and the checkpoints number s + 1. Rows
are keyed by (`episode_id`, `attempt`) with `episode_id` = "run:domain:task index:visit:sample index"
(`scheduling.tickets.episode_id`). The file is written to a hidden temp file in the same folder, fsynced and renamed over
the final name (`os.replace`, atomic on POSIX): a kill -9 mid-write leaves at most a `.step_*.tmp` file that no
reader and no `step_*.parquet` glob sees, and the next write of that step removes it. Writing a step again (a resume
that re-runs it, a retried write) replaces its file, and `cut(workdir, start)` removes the steps a resume from
checkpoint `start` will run again, so no key is ever archived twice.

The schema is versioned: `schema_version` in the file's key-value metadata (SCHEMA_VERSION). Readers accept older
versions: `read` fills columns a file lacks with nulls (an upgrade step per version may be added to `_UPGRADES`).
duckdb can query the files in place:

    duckdb.sql("SELECT domain, avg((reward >= 1)::INT) FROM read_parquet('RUN/archive/step_*.parquet') "
               "WHERE status <> 'infra_error' GROUP BY domain")

Columns (ARCHIVE_SCHEMA): episode_id, attempt, run, domain, task_index, visit, sample, try_index, retry_round, step,
policy_version, task_id, prompt_ids (list<int32>), completion_ids (list<int32>: every token after the prompt, env
turns included), prompt (the chat-rendered prompt as the model saw it, special tokens kept, as in the eval records),
completion (the replies, joined by newlines), reward (float64; null for an infra error: never scored), status,
truncated, in_batch, sampler_s, env_s, env_cost_s (env-reported sandbox CPU s, `info["cost"]`), details (a JSON
object string: env-, judge- and tool-specific fields).
"""
from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from posttrain.infra.files import atomic_write

from posttrain.scheduling.tickets import INFRA_ERROR, TaskTicket

SCHEMA_VERSION = 1
ARCHIVE_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("attempt", pa.int32()), ("run", pa.string()), ("domain", pa.string()),
    ("task_index", pa.int64()), ("visit", pa.int32()), ("sample", pa.int32()), ("try_index", pa.int32()),
    ("retry_round", pa.int32()), ("step", pa.int64()), ("policy_version", pa.int64()), ("task_id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())), ("completion_ids", pa.list_(pa.int32())), ("prompt", pa.string()),
    ("completion", pa.string()), ("reward", pa.float64()), ("status", pa.string()), ("truncated", pa.bool_()),
    ("in_batch", pa.bool_()), ("sampler_s", pa.float64()), ("env_s", pa.float64()), ("env_cost_s", pa.float64()),
    ("details", pa.string()),
])
KEY = ("episode_id", "attempt")
_STEP_FILE = re.compile(r"^step_(\d{8})\.parquet$")
_UPGRADES: dict[int, object] = {}  # version v -> function(table of v) -> table of v + 1


def archive_dir(workdir) -> pathlib.Path:
    return pathlib.Path(workdir) / "archive"


def step_path(workdir, step: int) -> pathlib.Path:
    return archive_dir(workdir) / f"step_{int(step):08d}.parquet"


def ticket_row(ticket: TaskTicket, sample: int, *, policy_version: int, status: str, reward: float | None,
               prompt_ids: Sequence[int] = (), completion_ids: Sequence[int] = (), prompt: str = "",
               completion: str = "", truncated: bool = False, in_batch: bool = False, sampler_s: float = 0.0,
               env_s: float = 0.0, env_cost_s: float = 0.0, details: Mapping | None = None) -> dict:
    """One archive row for sample `sample` of `ticket` (its run is `ticket.attempt`). The reward of an infra
    error is stored as null, never as a score. Raises ValueError for a sample not on the ticket."""
    if sample not in ticket.samples:
        raise ValueError(f"sample {sample} is not on ticket {ticket.ticket_id} (samples {ticket.samples})")
    return {"episode_id": ticket.episode_id(sample), "attempt": ticket.attempt, "run": ticket.run,
            "domain": ticket.domain, "task_index": ticket.task_index, "visit": ticket.visit, "sample": sample,
            "try_index": ticket.try_index, "retry_round": ticket.retry_round, "step": ticket.step,
            "policy_version": int(policy_version), "task_id": str(ticket.task.get("id", ticket.task_index)),
            "prompt_ids": [int(t) for t in prompt_ids], "completion_ids": [int(t) for t in completion_ids],
            "prompt": prompt, "completion": completion,
            "reward": None if status == INFRA_ERROR or reward is None else float(reward), "status": status,
            "truncated": bool(truncated), "in_batch": bool(in_batch), "sampler_s": float(sampler_s),
            "env_s": float(env_s), "env_cost_s": float(env_cost_s),
            "details": json.dumps(dict(details or {}), sort_keys=True, default=str)}


def to_table(rows: Sequence[Mapping] | pa.Table) -> pa.Table:
    """The rows (dicts with every ARCHIVE_SCHEMA column, or a Table of that schema) as a Table carrying the
    schema version. Raises ValueError for a missing or unknown column or a duplicate (episode_id, attempt)."""
    if isinstance(rows, pa.Table):
        table = rows.select(ARCHIVE_SCHEMA.names).cast(ARCHIVE_SCHEMA)
    else:
        names = set(ARCHIVE_SCHEMA.names)
        for r in rows:
            if set(r) != names:
                raise ValueError(f"archive row {r.get('episode_id')!r}: missing columns {sorted(names - set(r))}, "
                                 f"unknown columns {sorted(set(r) - names)}")
        table = pa.Table.from_pylist(list(rows), schema=ARCHIVE_SCHEMA)
    duplicates = _duplicate_keys(table)
    if duplicates:
        raise ValueError(f"archive rows repeat (episode_id, attempt) keys, e.g. {duplicates[:3]}")
    return table.replace_schema_metadata({"schema_version": str(SCHEMA_VERSION)})


def _duplicate_keys(table: pa.Table) -> list:
    counts = table.group_by(list(KEY)).aggregate([([], "count_all")])
    return counts.filter(pc.greater(counts["count_all"], 1)).select(list(KEY)).to_pylist()


def write_step(workdir, step: int, rows: Sequence[Mapping] | pa.Table) -> pathlib.Path:
    """Writes step `step`'s rows atomically (module docstring), replacing an earlier file of that step; returns
    its path. Raises ValueError for bad rows (`to_table`) before anything is written."""
    table = to_table(rows)
    return atomic_write(step_path(workdir, step), lambda f: pq.write_table(table, f, compression="zstd"),
                        binary=True, clear_stale=True)


def step_files(workdir, steps: Iterable[int] | None = None) -> dict[int, pathlib.Path]:
    """{step: file} of the archive (temp files never), optionally only `steps`."""
    folder = archive_dir(workdir)
    if not folder.is_dir():
        return {}
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))}
    if steps is not None:
        wanted = set(int(s) for s in steps)
        found = {s: p for s, p in found.items() if s in wanted}
    return dict(sorted(found.items()))


def cut(workdir, start: int) -> list[int]:
    """Removes the archive's steps >= `start` (a resume from checkpoint step `start` runs them again) and any
    temp file; returns the removed steps."""
    removed = [s for s in step_files(workdir) if s >= start]
    for s in removed:
        step_path(workdir, s).unlink()
    for stale in archive_dir(workdir).glob(".step_*.tmp"):
        stale.unlink(missing_ok=True)
    return removed


def _conform(table: pa.Table, path) -> pa.Table:
    """A table read from `path` at the current schema: older versions upgraded, missing columns null."""
    meta = table.schema.metadata or {}
    version = int(meta.get(b"schema_version", b"0"))
    if version > SCHEMA_VERSION:
        raise ValueError(f"{path}: archive schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
    while version < SCHEMA_VERSION and version in _UPGRADES:
        table, version = _UPGRADES[version](table), version + 1
    columns = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
               for f in ARCHIVE_SCHEMA]
    return pa.Table.from_arrays(columns, schema=ARCHIVE_SCHEMA)


def read(workdir, *, domain: str | Sequence[str] | None = None, status: str | Sequence[str] | None = None,
         steps: Iterable[int] | None = None, columns: Sequence[str] | None = None) -> pa.Table:
    """The archive's rows (ARCHIVE_SCHEMA, in step order), filtered to `domain`(s), `status`(es) and `steps`
    (e.g. range(10, 20)); `columns` picks columns; no rows for a run that has archived none yet. Raises
    FileNotFoundError when `workdir` does not exist (a mistyped run), ValueError for an unknown column or a file
    written by a newer schema version."""
    if not pathlib.Path(workdir).is_dir():
        raise FileNotFoundError(f"archive.read: {str(workdir)!r} is not a directory (a run's workdir holds archive/)")
    unknown = sorted(set(columns or ()) - set(ARCHIVE_SCHEMA.names))
    if unknown:
        raise ValueError(f"archive.read: unknown column(s) {unknown}; columns: {ARCHIVE_SCHEMA.names}")
    parts = [_conform(pq.read_table(p), p) for p in step_files(workdir, steps).values()]
    table = pa.concat_tables(parts) if parts else ARCHIVE_SCHEMA.empty_table()
    for name, value in (("domain", domain), ("status", status)):
        if value is not None:
            values = [value] if isinstance(value, str) else list(value)
            table = table.filter(pc.is_in(table[name], value_set=pa.array(values, pa.string())))
    return table.select(list(columns)) if columns else table
