"""The episode archive: one Parquet row per sample attempt, `workdir/archive/step_<8 digits>.parquet` per step,
written atomically, keyed by (episode_id, attempt) (layout, schema, columns: docs/scheduling.md)."""
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

SCHEMA_VERSION = 2  # 2: segment_index and image_hashes (long-horizon segments, image observations)
ARCHIVE_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("attempt", pa.int32()), ("run", pa.string()), ("domain", pa.string()),
    ("task_index", pa.int64()), ("visit", pa.int32()), ("sample", pa.int32()), ("try_index", pa.int32()),
    ("retry_round", pa.int32()), ("step", pa.int64()), ("policy_version", pa.int64()), ("task_id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())), ("completion_ids", pa.list_(pa.int32())), ("prompt", pa.string()),
    ("completion", pa.string()), ("reward", pa.float64()), ("status", pa.string()), ("truncated", pa.bool_()),
    ("in_batch", pa.bool_()), ("sampler_s", pa.float64()), ("env_s", pa.float64()), ("env_cost_s", pa.float64()),
    ("details", pa.string()), ("segment_index", pa.int32()), ("image_hashes", pa.list_(pa.string())),
])
# what a column added after version 1 holds in a file written before it (other missing columns read as null)
ADDED_DEFAULTS = {"segment_index": 0, "image_hashes": []}
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
               env_s: float = 0.0, env_cost_s: float = 0.0, details: Mapping | None = None, segment_index: int = 0,
               image_hashes: Sequence[str] = ()) -> dict:
    """One archive row for sample `sample` of `ticket` (an infra error's reward null); ValueError if not on it.

    Args:
        segment_index: the episode segment the row holds (0: the first; an episode longer than its context window
            continues in later segments, all sharing its episode id and reward).
        image_hashes: sha256 hex digests of the images the sample's observations carried, in order.
    """
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
            "details": json.dumps(dict(details or {}), sort_keys=True, default=str),
            "segment_index": int(segment_index), "image_hashes": [str(h) for h in image_hashes]}


def to_table(rows: Sequence[Mapping] | pa.Table) -> pa.Table:
    """The rows as a Table with the schema version; ValueError for a bad column or a duplicate key."""
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
    """Writes step `step`'s rows atomically, replacing an earlier file; ValueError for bad rows, before writing."""
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
    """Removes the archive's steps >= `start` (a resume runs them again) and temp files; returns the steps."""
    removed = [s for s in step_files(workdir) if s >= start]
    for s in removed:
        step_path(workdir, s).unlink()
    for stale in archive_dir(workdir).glob(".step_*.tmp"):
        stale.unlink(missing_ok=True)
    return removed


def _conform(table: pa.Table, path) -> pa.Table:
    """A table read from `path` at the current schema: older versions upgraded, added columns at their
    ADDED_DEFAULTS, other missing columns null."""
    meta = table.schema.metadata or {}
    version = int(meta.get(b"schema_version", b"0"))
    if version > SCHEMA_VERSION:
        raise ValueError(f"{path}: archive schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
    while version < SCHEMA_VERSION and version in _UPGRADES:
        table, version = _UPGRADES[version](table), version + 1
    columns = [table[f.name].cast(f.type) if f.name in table.column_names else
               pa.array([ADDED_DEFAULTS[f.name]] * len(table), f.type) if f.name in ADDED_DEFAULTS else
               pa.nulls(len(table), f.type) for f in ARCHIVE_SCHEMA]
    return pa.Table.from_arrays(columns, schema=ARCHIVE_SCHEMA)


def read(workdir, *, domain: str | Sequence[str] | None = None, status: str | Sequence[str] | None = None,
         steps: Iterable[int] | None = None, columns: Sequence[str] | None = None) -> pa.Table:
    """The archive's rows (ARCHIVE_SCHEMA, step order), filtered to `domain`(s), `status`(es) and `steps`.

    Raises FileNotFoundError for a missing `workdir`, ValueError for an unknown column or a newer schema version."""
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
