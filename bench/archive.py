"""Episode-archive benchmark: what `posttrain.scheduling.archive` costs a step, and how fast a run's archive answers.

    python bench/archive.py --json [--rows 1000000] [--step-s S | --metrics RUN/metrics.jsonl] [--keep DIR]
    python bench/archive.py --json --quick     # seconds: 10,000 rows, 5 step writes

1. Write cost per step: the rows of one quickstart step (8 prompts x 8 samples, 40 prompt and 24 completion
   tokens, texts) built with `archive.ticket_row` and written with `archive.write_step` (table, zstd Parquet,
   fsync, rename), median of --repeats writes; against the quickstart's step time: the median `perf/step_s` of
   --metrics, else --step-s (default: 205 s for its 24 training steps, measured on the 2-core CPU,
   ../shared/PLATFORM-NOTES.md). The goal is under 2%.
2. A per-domain pass-rate query over --rows rows of --completion-tokens-token completions (random ids and text,
   300 domains, 5% infra errors, 10,000 rows per step file written by `archive.write_step`), with duckdb reading
   the files in place (`read_parquet('.../step_*.parquet')`), best of 3 after one cold run; the goal is under 1 s
   on 2 cores. Without duckdb the same query runs through `archive.read` + pyarrow (`engine` says which).

Prints ONE JSON object: write_s_per_step, quickstart_step_s, write_ratio (write / step, the figure of the suite's
check), query_s, query_cold_s, query_goal_s (1.0), query_ratio, engine, rows, files, archive_bytes,
bulk_write_rows_per_s, step_rows, the step-time source and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from _helpers import parse_quick  # noqa: E402
from posttrain.scheduling import archive  # noqa: E402  (after the path tweak, so the bench runs from a checkout)
from posttrain.scheduling.tickets import TaskTicket  # noqa: E402

QUICKSTART_STEP_S = 205.0 / 24  # the quickstart's training seconds / steps (PLATFORM-NOTES)
QUICK = {"rows": 10_000, "repeats": 5}
ROWS_PER_FILE = 10_000
QUERY = ("SELECT domain, count(*) AS episodes, avg(CASE WHEN reward >= 1 THEN 1 ELSE 0 END) AS pass_rate "
         "FROM read_parquet('{glob}') WHERE status <> 'infra_error' GROUP BY domain")


def quickstart_step_rows(step: int, rng: np.random.Generator, prompts: int = 8, group: int = 8) -> list[dict]:
    """One quickstart step's archive rows: `prompts` x `group` samples of two-digit additions."""
    rows = []
    for p in range(prompts):
        t = TaskTicket(step * prompts + p, step, "quickstart", "arithmetic", int(rng.integers(10_000)), 0,
                       tuple(range(group)), 0, task={"id": f"arith-{p}"})
        prompt_ids = rng.integers(1, 49_152, 40).tolist()
        for s in t.samples:
            reply = rng.integers(1, 49_152, 24).tolist()
            ok = bool(rng.random() < 0.5)
            rows.append(archive.ticket_row(t, s, policy_version=step, status="ok" if ok else "wrong",
                                           reward=float(ok), prompt_ids=prompt_ids, completion_ids=reply,
                                           prompt="What is 59 + 63? Answer with just the number.",
                                           completion="The answer is 122.", in_batch=True, sampler_s=1.2,
                                           env_s=0.001, details={"answer": 122}))
    return rows


def _texts(rng: np.random.Generator, n: int, chars: int) -> pa.Array:
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    data = alphabet[rng.integers(0, len(alphabet), n * chars)]
    offsets = np.arange(0, (n + 1) * chars, chars, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))


def _ids(rng: np.random.Generator, n: int, length: int) -> pa.Array:
    values = pa.array(rng.integers(1, 152_064, n * length, dtype=np.int32))
    return pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * length, length, dtype=np.int32)), values)


def synthetic_table(step: int, n: int, completion_tokens: int, rng: np.random.Generator) -> pa.Table:
    """`n` archive rows of one step: 300 domains, 5% infra errors (reward null), rewards 0/1."""
    domain_ids = rng.integers(0, 300, n)
    status = np.where(rng.random(n) < 0.05, "infra_error", np.where(rng.random(n) < 0.4, "ok", "wrong"))
    reward = pa.array(np.where(status == "ok", 1.0, 0.0), mask=status == "infra_error")
    sample = np.arange(n) % 8
    domain = pa.array([f"domain_{d:03d}" for d in range(300)]).take(pa.array(domain_ids))
    episode = pa.array([f"bench:{d}:{i}:{step}:{s}" for d, i, s in zip(domain_ids, np.arange(n), sample)])
    ints = {"task_index": np.arange(n), "visit": np.full(n, step), "sample": sample, "try_index": np.zeros(n),
            "retry_round": np.zeros(n), "step": np.full(n, step), "policy_version": np.full(n, step)}
    columns = {"episode_id": episode, "attempt": pa.array(np.zeros(n, np.int32)), "run": pa.array(["bench"] * n),
               "domain": domain, **{k: pa.array(v) for k, v in ints.items()}, "task_id": episode,
               "prompt_ids": _ids(rng, n, 64), "completion_ids": _ids(rng, n, completion_tokens),
               "prompt": _texts(rng, n, 256), "completion": _texts(rng, n, 4 * completion_tokens), "reward": reward,
               "status": pa.array(status), "truncated": pa.array(np.zeros(n, bool)),
               "in_batch": pa.array(status != "infra_error"), "sampler_s": pa.array(np.full(n, 1.5)),
               "env_s": pa.array(np.full(n, 0.01)), "env_cost_s": pa.array(np.full(n, 0.01)),
               "details": pa.array(["{}"] * n), "segment_index": pa.array(np.zeros(n, np.int32)),
               "image_hashes": pa.array([[]] * n, pa.list_(pa.string()))}
    return pa.table({f.name: columns[f.name] for f in archive.ARCHIVE_SCHEMA})


def step_seconds(args) -> tuple[float, str]:
    if args.metrics:
        with open(args.metrics) as f:
            values = [r["perf/step_s"] for r in map(json.loads, f) if "perf/step_s" in r]
        if not values:
            raise SystemExit(f"--metrics {args.metrics}: no perf/step_s in it")
        return statistics.median(values), f"median perf/step_s of {args.metrics}"
    return args.step_s, "--step-s" if args.step_s != QUICKSTART_STEP_S else "the quickstart: 205 s / 24 steps"


def time_query(workdir) -> tuple[float, float, str, list]:
    """(best, cold, engine, result rows) of the per-domain pass-rate query."""
    try:
        import duckdb
    except ImportError:
        duckdb = None
    glob = str(archive.archive_dir(workdir) / "step_*.parquet")

    def run():
        if duckdb is not None:
            return duckdb.sql(QUERY.format(glob=glob)).fetchall()
        t = archive.read(workdir, columns=["domain", "reward", "status"])
        t = t.filter(pc.not_equal(t["status"], "infra_error"))
        t = t.append_column("pass", pc.cast(pc.greater_equal(t["reward"], 1.0), pa.float64()))
        return t.group_by("domain").aggregate([("pass", "count"), ("pass", "mean")]).to_pylist()

    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    return min(times[1:]), times[0], "duckdb" if duckdb is not None else "pyarrow", result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the query's archive")
    ap.add_argument("--completion-tokens", type=int, default=300, help="completion ids (and ~4 chars each) per row")
    ap.add_argument("--repeats", type=int, default=20, help="quickstart-step writes timed (the median counts)")
    ap.add_argument("--step-s", type=float, default=QUICKSTART_STEP_S, help="the quickstart's step seconds")
    ap.add_argument("--metrics", default="", help="a quickstart run's metrics.jsonl: its median perf/step_s")
    ap.add_argument("--keep", default="", help="write the archives under this directory and keep them")
    args = parse_quick(ap, argv, QUICK)
    if args.rows < 1 or args.repeats < 1 or args.completion_tokens < 1:
        ap.error("--rows, --repeats and --completion-tokens must be >= 1")
    step_s, source = step_seconds(args)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=args.keep or None) as tmp:
        root = args.keep or tmp
        step_dir, big_dir = os.path.join(root, "steps"), os.path.join(root, "big")
        writes = []
        for step in range(args.repeats):
            t0 = time.perf_counter()
            archive.write_step(step_dir, step, quickstart_step_rows(step, rng))
            writes.append(time.perf_counter() - t0)
        files, t0 = 0, time.perf_counter()
        for start in range(0, args.rows, ROWS_PER_FILE):
            archive.write_step(big_dir, files, synthetic_table(files, min(ROWS_PER_FILE, args.rows - start),
                                                               args.completion_tokens, rng))
            files += 1
        bulk_s = time.perf_counter() - t0
        query_s, cold_s, engine, result = time_query(big_dir)
        size = sum(p.stat().st_size for p in archive.step_files(big_dir).values())
    write_s = statistics.median(writes)
    out = {"quick": args.quick, "write_s_per_step": write_s, "quickstart_step_s": step_s,
           "write_ratio": write_s / step_s, "step_s_source": source, "step_rows": 64, "write_repeats": args.repeats,
           "query_s": query_s, "query_cold_s": cold_s, "query_goal_s": 1.0, "query_ratio": query_s / 1.0,
           "engine": engine, "domains_answered": len(result), "rows": args.rows, "files": files,
           "completion_tokens": args.completion_tokens, "archive_bytes": size,
           "bulk_write_rows_per_s": args.rows / bulk_s, "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
