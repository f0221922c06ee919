"""The episode archive: Parquet per step, atomic (a kill -9 mid-write leaves no partial file), never duplicated on a
rewrite or resume, versioned, filtered reads, and duckdb querying the files in place."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest

from posttrain.scheduling import archive
from posttrain.scheduling.tickets import TaskTicket

ROOT = pathlib.Path(__file__).resolve().parents[3]


def rows(step: int, domains=("math", "code"), samples=2, attempt=0):
    out = []
    for i, d in enumerate(domains):
        t = TaskTicket(step * 10 + i, step, "run", d, task_index=i, visit=step, samples=tuple(range(samples)),
                       attempt=attempt, task={"id": f"{d}-{i}"})
        for s in t.samples:
            status = "infra_error" if (d, s) == ("code", 1) else "ok"
            out.append(archive.ticket_row(t, s, policy_version=step, status=status, reward=1.0, prompt_ids=[1, 2],
                                          completion_ids=[3] * (s + 1), prompt="q", completion="a", in_batch=True,
                                          env_cost_s=0.01, details={"judge": d}))
    return out


def test_write_read_round_trip_with_filters_and_version(tmp_path):
    for step in range(3):
        archive.write_step(tmp_path, step, rows(step))
    table = archive.read(tmp_path)
    assert table.schema == archive.ARCHIVE_SCHEMA and table.num_rows == 12
    assert table["step"].to_pylist() == [0] * 4 + [1] * 4 + [2] * 4
    first = table.slice(0, 1).to_pylist()[0]
    assert first["episode_id"] == "run:math:0:0:0" and first["task_id"] == "math-0"
    assert json.loads(first["details"]) == {"judge": "math"} and first["completion_ids"] == [3]
    meta = pq.read_schema(archive.step_path(tmp_path, 1)).metadata
    assert meta[b"schema_version"] == str(archive.SCHEMA_VERSION).encode()
    code = archive.read(tmp_path, domain="code", status="infra_error", steps=range(1, 3), columns=["step", "reward"])
    assert code.to_pylist() == [{"step": 1, "reward": None}, {"step": 2, "reward": None}]  # infra: never scored
    assert archive.read(tmp_path, domain=["math", "code"], status=("ok",)).num_rows == 9
    with pytest.raises(FileNotFoundError, match="nowhere' is not a directory"):  # a mistyped run is no empty one
        archive.read(tmp_path / "nowhere")
    (tmp_path / "fresh").mkdir()
    assert archive.read(tmp_path / "fresh").num_rows == 0  # a run that has archived nothing yet
    with pytest.raises(ValueError, match="unknown column"):
        archive.read(tmp_path, columns=["nope"])


def test_no_duplicates_on_rewrite_or_resume_and_bad_rows_raise(tmp_path):
    for step in range(4):
        archive.write_step(tmp_path, step, rows(step))
    archive.write_step(tmp_path, 2, rows(2))  # a retried write of one step replaces its file
    assert archive.cut(tmp_path, 3) == [3]  # a resume from checkpoint step 3 runs step 3 again
    archive.write_step(tmp_path, 3, rows(3))
    table = archive.read(tmp_path)
    keys = list(zip(table["episode_id"].to_pylist(), table["attempt"].to_pylist()))
    assert len(keys) == len(set(keys)) == 16
    with pytest.raises(ValueError, match="repeat"):
        archive.write_step(tmp_path, 5, rows(5) + rows(5)[:1])
    bad = rows(6)
    del bad[0]["details"]
    with pytest.raises(ValueError, match="missing columns"):
        archive.write_step(tmp_path, 6, bad)
    assert sorted(archive.step_files(tmp_path)) == [0, 1, 2, 3]  # nothing written for the bad steps


def test_a_crash_inside_the_write_leaves_no_partial_file(tmp_path, monkeypatch):
    archive.write_step(tmp_path, 0, rows(0))

    def crash(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(archive.pq, "write_table", crash)
    with pytest.raises(KeyboardInterrupt):
        archive.write_step(tmp_path, 1, rows(1))
    assert sorted(p.name for p in (tmp_path / "archive").iterdir()) == ["step_00000000.parquet"]


CHILD = textwrap.dedent("""
    import pathlib, sys, time
    sys.path.insert(0, sys.argv[3])
    from test_archive import rows
    from posttrain.scheduling import archive
    real = archive.pq.write_table
    def slow(table, where, **kwargs):
        real(table.slice(0, 1), where, **kwargs)  # part of the data is in the temp file
        where.flush()
        pathlib.Path(sys.argv[2]).touch()
        time.sleep(60)
    archive.pq.write_table = slow
    archive.write_step(sys.argv[1], 1, rows(1))
""")


def test_kill_9_inside_the_write_leaves_no_partial_file(tmp_path):
    archive.write_step(tmp_path, 0, rows(0))
    ready = tmp_path / "ready"
    here = str(pathlib.Path(__file__).parent)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(ready), here],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"the writer never reached the write (exit code {child.poll()})"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    names = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert names[1:] == ["step_00000000.parquet"]
    assert names[0].startswith(".step_00000001.") and names[0].endswith(".tmp")  # the dead writer's temp file
    assert sorted(archive.step_files(tmp_path)) == [0] and archive.read(tmp_path).num_rows == 4
    archive.write_step(tmp_path, 1, rows(1))  # the step's next write clears the stale temp file
    names = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert names == ["step_00000000.parquet", "step_00000001.parquet"]


def test_older_files_are_read_at_the_current_schema_and_newer_ones_refused(tmp_path):
    archive.write_step(tmp_path, 1, rows(1))
    old = archive.to_table(rows(0)).drop_columns(["details", "in_batch"])
    old = old.replace_schema_metadata({"schema_version": "0"})
    pq.write_table(old, archive.step_path(tmp_path, 0))
    table = archive.read(tmp_path)
    assert table.schema == archive.ARCHIVE_SCHEMA and table["details"].null_count == 4 == table["in_batch"].null_count
    newer = archive.to_table(rows(2)).replace_schema_metadata({"schema_version": str(archive.SCHEMA_VERSION + 1)})
    pq.write_table(newer, archive.step_path(tmp_path, 2))
    with pytest.raises(ValueError, match="newer"):
        archive.read(tmp_path)


def test_a_version_1_archive_reads_with_the_added_columns_at_their_defaults(tmp_path):
    """Files written before segment_index and image_hashes existed (schema 1) read as segment 0 without images."""
    archive.write_step(tmp_path, 1, [{**r, "segment_index": 2, "image_hashes": ["ab" * 32]} for r in rows(1)])
    old = archive.to_table(rows(0)).drop_columns(["segment_index", "image_hashes"])
    pq.write_table(old.replace_schema_metadata({"schema_version": "1"}), archive.step_path(tmp_path, 0))
    table = archive.read(tmp_path)
    assert table["segment_index"].to_pylist() == [0] * 4 + [2] * 4
    assert table["image_hashes"].to_pylist() == [[]] * 4 + [["ab" * 32]] * 4
    assert archive.read(tmp_path, steps=[0]).num_rows == 4 and table.schema == archive.ARCHIVE_SCHEMA


def test_duckdb_queries_the_archive_in_place(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    for step in range(3):
        archive.write_step(tmp_path, step, rows(step))
    glob = str(tmp_path / "archive" / "step_*.parquet")
    got = duckdb.sql(f"SELECT domain, count(*) AS n, avg((reward >= 1)::INT) AS pass_rate FROM read_parquet('{glob}') "
                     "WHERE status <> 'infra_error' GROUP BY domain ORDER BY domain").fetchall()
    assert got == [("code", 3, 1.0), ("math", 6, 1.0)]
