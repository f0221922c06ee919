"""Shows that two revisions of this repository produce the same training outputs: runs the tiny CPU recipes with
each revision's code (this venv's interpreter, `PYTHONPATH=<tree>` first, cwd = the tree) and compares, timing
aside, metrics.jsonl row by row, every parquet file cell by cell, each checkpoint's array checksums (its manifest's,
`posttrain.checkpoints.checksum`) and meta, eval/step_*.jsonl, config.json, status.json, summary.json and an
exported reward_model/ (its JSON files key by key, other files by sha256). `tiny_rm` (after `rm`, which it needs:
a tiny reward model that its GRPO run scores replies with, `rewards.model`) has real updates, unlike tiny's all-0
rewards: its report gives each side's optim/grad_norm per step and `learns`, false (a difference) when a side's
grad_norm is 0 (or absent) at every step.

  .venv/bin/python scripts/compare_commits.py OLD NEW [--runs tiny,...] [--out DIR] [--keep] [--resume-from OLD]
      [--extra-new-flags='--config.optim.lr=2e-5' [--extra-new-runs=tiny_rm]]  (a planted difference)

OLD, NEW: git revisions, or WORKTREE (this checkout, uncommitted changes included); others are checked out by
`git worktree add --detach` in a temp folder (removed unless --keep). Prints a JSON report on stdout and a line per
run on stderr; exits 0 when all is identical, 1 when not (or a run failed), 2 on a usage or setup error (an unknown
revision; a tree whose `posttrain` or `envs` is not the one its runs import)."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"
# name -> CLI arguments (cwd = the tree); tiny pins its steps, so that a config edit cannot change them
TINY = ["train", "--config=configs/tiny.py", "--config.train.steps=4", "--config.checkpoint.every_steps=2"]
# "{side}": the side's output folder (out/old, out/new), where a run finds the runs it NEEDS
RUNS = {"tiny": TINY, "tiny_tasks": TINY + ["--config.tasks.enabled=True"],
        "sft_tiny": ["sft", "--config=configs/sft_tiny.py"], "dpo_tiny": ["dpo", "--config=configs/dpo_tiny.py"],
        "rm": ["rm", "--config=configs/rm_tiny.py", "--config.rm.export=True"],
        "tiny_rm": TINY + ["--config.rewards.model={side}/rm"]}
NEEDS = {"tiny_rm": "rm"}  # run -> the run (of the same side) it reads, run before it
MUST_LEARN = ("tiny_rm",)  # runs whose optim/grad_norm must be > 0 at some step (`learning`)
GRAD_NORM = "optim/grad_norm"
EXPORT_DIR = "reward_model"  # `posttrain rm`'s export (`posttrain.checkpoints.reward_model.RUN_SUBDIR`)
RESUME_STEP = 2  # the tiny run's checkpoint (of 4 steps) the resume check restarts from
# Timing keys of metrics.jsonl, summary.json and eval records, never compared: perf/* (step_s, gen_s, tokens_per_s,
# peak_rss_gb, idle_ratio_*, ...), names ending in `_s` (seconds: train_wall_s, the job scheduler's measured env
# seconds tasks/<domain>/cpu_s and cost_s), wall/time/elapsed/timestamp as a word (env/timeout_rate is compared).
TIMING_KEY = re.compile(r"(^|/)perf/|_s$|(^|[/_])(wall|time|elapsed|timestamp)([/_]|$)|tokens_per_s|peak_rss")
# Episode archive columns measured by the clock: sampler and env seconds per episode, the env's reported CPU cost
TIMING_COLUMNS = ("sampler_s", "env_s", "env_cost_s")
NOT_COMPARED = ("tensorboard/ (event wall times)", "reward_curve.png (a rendering of metrics.jsonl)")
DIFFS_PER_PART = 4  # differences listed per part of a run (all are counted)
PLACEHOLDER, SIDE_PLACEHOLDER = "<RUN_DIR>", "<SIDE_DIR>"


class SetupError(Exception):
    """A revision that cannot be checked out, or whose tree is not the code a run imports."""


def is_timing(key: str) -> bool:
    """Whether a metric name, JSON path or column `key` is a timing measurement (TIMING_KEY, TIMING_COLUMNS)."""
    return key in TIMING_COLUMNS or bool(TIMING_KEY.search(key))


def same(a, b) -> bool:
    """Exact equality of two JSON or parquet values: same type (1 and 1.0 differ), NaN equal to NaN."""
    if type(a) is not type(b) or isinstance(a, float):
        return type(a) is type(b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def flatten(obj, prefix: str = "") -> dict:
    """{"a/b/0": leaf} of a nested JSON value (an empty dict or list is a leaf)."""
    if not obj or not isinstance(obj, (dict, list)):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return {k: v for key, val in items for k, v in flatten(val, f"{prefix}/{key}" if prefix else str(key)).items()}


def load_json(path: pathlib.Path, run_dir: pathlib.Path, lines: bool = False):
    """The JSON value of `path` (with `lines`: its list of JSONL records), the run folder's own path (as given and
    resolved) replaced by PLACEHOLDER first, then its parent's (the side's folder: tiny_rm's rewards.model) by
    SIDE_PLACEHOLDER."""
    text = path.read_text()
    for d, mark in ((run_dir, PLACEHOLDER), (run_dir.parent, SIDE_PLACEHOLDER)):
        for p in sorted({str(d), str(d.resolve())}, key=len, reverse=True):
            text = text.replace(p, mark)
    return [json.loads(s) for s in text.splitlines() if s.strip()] if lines else json.loads(text)


def _only(key, old_has: bool) -> str:
    return f"{key} only in {'old' if old_has else 'new'}"


def diff_json(name: str, old, new, skip: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(leaves compared, differences) of two JSON values, leaf by leaf, timing leaves and the subtrees `skip`
    (top-level keys) aside."""
    fo, fn = flatten(old), flatten(new)
    keys = [k for k in dict.fromkeys([*fo, *fn]) if not is_timing(k) and k.split("/")[0] not in skip]
    diffs = [f"{name}: " + (_only(k, k in fo) if (k in fo) != (k in fn) else f"{k}: {fo[k]!r} != {fn[k]!r}")
             for k in keys if k not in fo or k not in fn or not same(fo[k], fn[k])]
    return len(keys), diffs


def diff_rows(name: str, old: list[dict], new: list[dict]) -> tuple[dict, list[str]]:
    """Counts and differences of two lists of records (metrics.jsonl rows, eval records): row by row in file
    order, key by key, timing keys aside; each difference names the row, its step and the key."""
    counts, diffs = {"rows": max(len(old), len(new)), "values": 0, "timing_skipped": 0}, []
    if len(old) != len(new):
        diffs.append(f"{name}: {len(old)} rows in old, {len(new)} in new")
    for i, (a, b) in enumerate(zip(old, new)):
        where = f"{name}: row {i}" + (f" (step {a['step']})" if "step" in a else "")
        for k in dict.fromkeys([*a, *b]):
            if is_timing(k):
                counts["timing_skipped"] += 1
            elif k not in a or k not in b:
                diffs.append(f"{where}: key {_only(repr(k), k in a)}")
            else:
                counts["values"] += 1
                if not same(a[k], b[k]):
                    diffs.append(f"{where}: key {k!r}: {a[k]!r} != {b[k]!r}")
    return counts, diffs


def _listing(old_dir, new_dir, pattern: str, what: str) -> tuple[list[str], list[str]]:
    """(paths matching `pattern` in both folders, differences for the paths in one only)."""
    o, n = ({p.relative_to(d).as_posix() for p in d.glob(pattern)} for d in (old_dir, new_dir))
    return sorted(o & n), [f"{what} {_only(x, x in o)}" for x in sorted(o ^ n)]


def compare_metrics(old_dir: pathlib.Path, new_dir: pathlib.Path) -> tuple[dict, list[str]]:
    """metrics.jsonl of two run folders (`diff_rows`)."""
    if not all((d / "metrics.jsonl").is_file() for d in (old_dir, new_dir)):
        return {}, ["metrics.jsonl missing"]
    return diff_rows("metrics.jsonl", *(load_json(d / "metrics.jsonl", d, lines=True) for d in (old_dir, new_dir)))


def compare_parquets(old_dir: pathlib.Path, new_dir: pathlib.Path) -> tuple[dict, list[str]]:
    """Every *.parquet of two run folders (archive/step_*.parquet, reference_logps.parquet): the same files, and
    per file its schema, row count and every cell (the first differing row of a column), timing columns aside."""
    import pyarrow.parquet as pq

    names, diffs = _listing(old_dir, new_dir, "**/*.parquet", "parquet file")
    counts, skipped = {"files": len(names), "rows": 0, "cells": 0}, set()
    for name in names:
        a, b = (pq.read_table(d / name) for d in (old_dir, new_dir))
        counts["rows"] += a.num_rows
        if a.num_rows != b.num_rows:
            diffs.append(f"{name}: {a.num_rows} rows in old, {b.num_rows} in new")
        skipped |= {c for c in a.column_names + b.column_names if is_timing(c)}
        fa, fb = ([f for f in t.schema if not is_timing(f.name)] for t in (a, b))
        if fa != fb or a.schema.metadata != b.schema.metadata:
            diffs.append(f"{name}: schema {fa} {a.schema.metadata} != {fb} {b.schema.metadata}")
        for c in (f.name for f in fa if f in fb):
            va, vb = a.column(c).to_pylist(), b.column(c).to_pylist()
            counts["cells"] += min(len(va), len(vb))
            bad = next((i for i, (x, y) in enumerate(zip(va, vb)) if not same(x, y)), None)
            if bad is not None:
                diffs.append(f"{name}: column {c!r} row {bad}: {va[bad]!r} != {vb[bad]!r}")
    return {**counts, "timing_skipped": sorted(skipped)}, diffs


def array_digests(state_dir: pathlib.Path) -> dict:
    """{path: sha256 hex of its bytes} of every array of a checkpoint's `state` item, restored by orbax."""
    import hashlib
    import warnings

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    warnings.filterwarnings("ignore", "Sharding info not provided")  # none is wanted: arrays to hash
    tree = ocp.PyTreeCheckpointer().restore(str(state_dir.resolve()))
    return {"/".join(str(getattr(k, "key", k)) for k in path): hashlib.sha256(
        np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def compare_checkpoints(old_dir: pathlib.Path, new_dir: pathlib.Path, hash_arrays: bool = False,
                        only: int | None = None) -> tuple[dict, list[str]]:
    """checkpoints/<step>/ of two run folders (or only step `only`): the same steps, and per step every array's
    path, shape, dtype and content checksum (the manifest's), and the meta item (run config, data cursors). An
    array with no checksum (a 4-bit dtype), or every one with `hash_arrays`, is restored: its bytes' sha256."""
    names, diffs = _listing(old_dir, new_dir, "checkpoints/*", "checkpoint")
    steps = sorted(int(n.split("/")[1]) for n in names if n.split("/")[1].isdigit())
    steps = [s for s in steps if only in (None, s)]
    counts = {"steps": steps, "arrays": 0, "hashed": 0, "meta_values": 0}
    for name in (f"checkpoints/{s}" for s in steps):
        a, b = ({r["path"]: r for r in json.loads((d / name / "manifest" / "metadata").read_text())["leaves"]}
                for d in (old_dir, new_dir))
        diffs += [f"{name}: array {_only(p, p in a)}" for p in sorted(a.keys() ^ b.keys())]
        common = sorted(a.keys() & b.keys())
        counts["arrays"] += len(common)
        diffs += [f"{name}: {p}: {f} {a[p].get(f)} != {b[p].get(f)}" for p in common
                  for f in ("shape", "dtype", "checksum") if not same(a[p].get(f), b[p].get(f))]
        unchecked = [p for p in common if hash_arrays or a[p].get("checksum") is None]
        if unchecked:
            ha, hb = (array_digests(d / name / "state") for d in (old_dir, new_dir))
            counts["hashed"] += len(unchecked)
            diffs += [f"{name}: {p}: sha256 differs" + ("" if p in ha and p in hb else " (not restored)")
                      for p in unchecked if p not in ha or ha.get(p) != hb.get(p)]
        metas = (load_json(x / name / "meta" / "metadata", x) for x in (old_dir, new_dir))
        n, d = diff_json(f"{name}/meta", *metas)
        counts["meta_values"] += n
        diffs += d
    return counts, diffs


def compare_json_files(old_dir: pathlib.Path, new_dir: pathlib.Path) -> tuple[dict, list[str]]:
    """eval/step_*.jsonl records (`diff_rows`), config.json, status.json and summary.json (its `config` copy
    aside: config.json is compared) of two run folders, timing keys aside."""
    evals, diffs = _listing(old_dir, new_dir, "eval/step_*.jsonl", "eval file")
    counts = {"eval_files": len(evals), "eval_values": 0, "json_values": 0}
    for name in evals:
        c, d = diff_rows(name, *(load_json(x / name, x, lines=True) for x in (old_dir, new_dir)))
        counts["eval_values"] += c["values"]
        diffs += d
    for name, skip in (("config.json", ()), ("status.json", ()), ("summary.json", ("config",))):
        found, d = _listing(old_dir, new_dir, name, "file")
        diffs += d
        if found:
            n, d = diff_json(name, *(load_json(x / name, x) for x in (old_dir, new_dir)), skip=skip)
            counts["json_values"] += n
            diffs += d
    return counts, diffs


def compare_export(old_dir: pathlib.Path, new_dir: pathlib.Path) -> tuple[dict, list[str]]:
    """The files of reward_model/ (EXPORT_DIR, if any) of two run folders: the same names, *.json files key by key
    (`diff_json`: timing keys aside), the others (safetensors, tokenizer) by their bytes' sha256."""
    import hashlib

    names, diffs = _listing(old_dir, new_dir, f"{EXPORT_DIR}/**/*", "export file")
    names = [n for n in names if (old_dir / n).is_file()]
    counts = {"files": len(names), "json_values": 0, "hashed": 0}
    for name in names:
        if name.endswith(".json"):
            n, d = diff_json(name, *(load_json(x / name, x) for x in (old_dir, new_dir)))
            counts["json_values"] += n
            diffs += d
        else:
            counts["hashed"] += 1
            ha, hb = (hashlib.sha256((x / name).read_bytes()).hexdigest() for x in (old_dir, new_dir))
            diffs += [f"{name}: sha256 {ha[:12]}.. != {hb[:12]}.."] if ha != hb else []
    return counts, diffs


def grad_norms(run_dir: pathlib.Path) -> list:
    """[[step, optim/grad_norm], ...] of the metrics.jsonl rows of `run_dir` that have one."""
    path = run_dir / "metrics.jsonl"
    rows = load_json(path, run_dir, lines=True) if path.is_file() else []
    return [[r.get("step"), r[GRAD_NORM]] for r in rows if GRAD_NORM in r]


def learning(old_dir: pathlib.Path, new_dir: pathlib.Path) -> tuple[dict, list[str]]:
    """({"learns", "grad_norm": {side: [[step, value], ...]}}, differences): a run learns when on each side its
    optim/grad_norm is > 0 (and finite) at some step; a side where it is 0 or absent at every step is a
    difference (its updates are none: a change of the loss, advantages or gradients would go unseen)."""
    norms = {"old": grad_norms(old_dir), "new": grad_norms(new_dir)}
    dead = [side for side, v in norms.items()
            if not any(isinstance(g, (int, float)) and math.isfinite(g) and g > 0 for _, g in v)]
    diffs = [f"{side}: {GRAD_NORM} is 0 or absent at every step ({len(norms[side])} rows have it): no update"
             for side in dead]
    return {"learns": not dead, "grad_norm": norms}, diffs


def compare_run(old_dir: pathlib.Path, new_dir: pathlib.Path, hash_arrays: bool = False) -> dict:
    """{"identical", "compared": {part: counts}, "n_differences", "differences": some of each part}, two run folders."""
    parts = {"metrics": compare_metrics, "parquet": compare_parquets, "json": compare_json_files,
             "checkpoints": lambda a, b: compare_checkpoints(a, b, hash_arrays), "export": compare_export}
    compared, listed, total = {}, [], 0
    for part, fn in parts.items():
        counts, diffs = fn(old_dir, new_dir)
        compared[part] = {**counts, "differences": len(diffs)}
        listed += diffs[:DIFFS_PER_PART]
        total += len(diffs)
    return {"identical": total == 0, "compared": compared, "n_differences": total, "differences": listed}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The commit id of `rev` (WORKTREE: HEAD's, + "+worktree"). Raises SetupError for an unknown revision."""
    try:
        sha = git("rev-parse", "--verify", ("HEAD" if rev == WORKTREE else rev) + "^{commit}")
    except subprocess.CalledProcessError as e:
        raise SetupError(f"unknown revision {rev!r}: {e.stderr.strip()}") from None
    return sha + "+worktree" if rev == WORKTREE else sha


def checkout(rev: str, made: list) -> pathlib.Path:
    """The tree to run `rev` from: this checkout for WORKTREE, else a new detached worktree (added to `made`)."""
    if rev == WORKTREE:
        return REPO
    tree = pathlib.Path(tempfile.mkdtemp(prefix="compare_commits_")) / "tree"
    git("worktree", "add", "--detach", "--quiet", str(tree), resolve(rev))
    made.append(tree)
    return tree


def run_env(tree: pathlib.Path) -> dict:
    """A run's environment, the same but for the tree: PYTHONPATH=tree first, CPU, no XLA disk cache, hash seed 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.update(JAX_PLATFORMS="cpu", POSTTRAIN_XLA_CACHE="0", PYTHONHASHSEED="0")
    return env


def check_imports(tree: pathlib.Path) -> dict:
    """{package: file} of `posttrain` and `envs` as a run in `tree` imports them; SetupError if not the tree's."""
    code = "import json, posttrain, envs; print(json.dumps({'posttrain': posttrain.__file__, 'envs': envs.__file__}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env=run_env(tree), capture_output=True, text=True)
    if p.returncode:
        raise SetupError(f"importing posttrain and envs in {tree} failed: {p.stderr.strip()[-800:]}")
    files = json.loads(p.stdout.splitlines()[-1])
    wrong = {k: f for k, f in files.items() if not pathlib.Path(f).resolve().is_relative_to(tree.resolve())}
    if wrong:
        raise SetupError(f"a run in {tree} imports {wrong}, not the tree's own packages")
    return files


def run_cli(tree: pathlib.Path, args: list[str], workdir: pathlib.Path) -> tuple[int, float, pathlib.Path]:
    """(exit code, seconds, log WORKDIR.log) of `python -m posttrain.cli ARGS --workdir=WORKDIR` run in `tree`."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    log, t0 = workdir.with_name(workdir.name + ".log"), time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "posttrain.cli", *args, f"--workdir={workdir}", "--noprogress"],
                            cwd=tree, env=run_env(tree), stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t0, log


def _tail(log: pathlib.Path) -> str:  # a run log's last lines, for the report
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]


def run_args(name: str, side_dir: pathlib.Path) -> list[str]:
    """RUNS[name] with "{side}" replaced by the side's output folder."""
    return [a.replace("{side}", str(side_dir)) for a in RUNS[name]]


def with_learning(report: dict, old_dir: pathlib.Path, new_dir: pathlib.Path) -> dict:
    """`report` (of `compare_run`) with `learning`'s keys added, a dead side counted as a difference."""
    info, diffs = learning(old_dir, new_dir)
    return {**report, **info, "identical": report["identical"] and not diffs,
            "n_differences": report["n_differences"] + len(diffs), "differences": diffs + report["differences"]}


def run_both(name: str, trees: dict, out: pathlib.Path, extra_new: list[str], hash_arrays: bool,
             seconds: dict) -> dict:
    """Runs `name` with each side's tree into out/<side>/<name> (timed into `seconds`), then `compare_run` (and
    `learning` for MUST_LEARN runs)."""
    failed = []
    for side, tree in trees.items():
        print(f"[{side}] {name} ...", file=sys.stderr, flush=True)
        rc, secs, log = run_cli(tree, run_args(name, out / side) + (extra_new if side == "new" else []),
                                out / side / name)
        seconds[side][name] = round(secs, 1)
        seconds[side]["total"] = round(seconds[side]["total"] + secs, 1)
        print(f"[{side}] {name}: exit {rc} in {secs:.1f} s", file=sys.stderr, flush=True)
        if rc:
            failed.append(f"{side} run failed (exit {rc}, {log}): {_tail(log)}")
    if failed:
        r = {"identical": False, "compared": {}, "n_differences": len(failed), "differences": failed}
        return {**r, "learns": False} if name in MUST_LEARN else r
    r = compare_run(out / "old" / name, out / "new" / name, hash_arrays)
    return with_learning(r, out / "old" / name, out / "new" / name) if name in MUST_LEARN else r


def resume_check(source: pathlib.Path, new_tree: pathlib.Path, out: pathlib.Path) -> dict:
    """Resumes a copy of a finished tiny run (`source`) from RESUME_STEP with NEW's tree: did it, and are its rows
    after that step and its last checkpoint those of NEW's uninterrupted run (out/new/tiny)?"""
    work, own = out / "resume" / "tiny", out / "new" / "tiny"  # named as the runs: the archive's `run` column
    if not (source / "checkpoints" / str(RESUME_STEP)).is_dir() or not (own / "metrics.jsonl").is_file():
        return {"resumed": False, "start_step": None, "identical": False, "error": "a tiny run failed: nothing to do"}
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    for d in (work / "checkpoints").iterdir():
        if not d.name.isdigit() or int(d.name) > RESUME_STEP:
            shutil.rmtree(d) if d.is_dir() else d.unlink()
    print(f"[resume] tiny from step {RESUME_STEP} with NEW ...", file=sys.stderr, flush=True)
    rc, secs, log = run_cli(new_tree, RUNS["tiny"], work)
    start = json.loads((work / "summary.json").read_text()).get("start_step") if rc == 0 else None
    report = {"rc": rc, "seconds": round(secs, 1), "start_step": start, "resumed": rc == 0 and start == RESUME_STEP}
    if rc:
        return {**report, "identical": False, "error": _tail(log)}
    after = [[r for r in load_json(d / "metrics.jsonl", d, lines=True) if r.get("step", 0) > RESUME_STEP]
             for d in (work, own)]
    counts, diffs = diff_rows(f"metrics.jsonl steps > {RESUME_STEP}", *after)
    last = max(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    c, d = compare_checkpoints(work, own, only=last)  # the resumed run wrote only this one
    return {**report, "identical": not (diffs + d), "compared": {"metrics": counts, "checkpoints": c},
            "differences": diffs[:DIFFS_PER_PART] + d[:DIFFS_PER_PART]}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help=f"git revision, or {WORKTREE}")
    p.add_argument("new", help=f"git revision, or {WORKTREE}")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated names (default: all; a run's NEEDS "
                   "are added before it)")
    p.add_argument("--out", help="output folder (default: a temp folder, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the worktrees and the temp output folder")
    p.add_argument("--resume-from", metavar="OLD", help=f"resume OLD's tiny run from step {RESUME_STEP} with NEW")
    p.add_argument("--hash-arrays", action="store_true", help="also compare every checkpoint array's sha256")
    p.add_argument("--extra-new-flags", default="", help="CLI flags for NEW's runs only (plants a difference)")
    p.add_argument("--extra-new-runs", default="", help="comma-separated runs that get --extra-new-flags (default: "
                   "all; e.g. tiny_rm: a GRPO flag that rm's config lacks, or an rm left as it is)")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or set(args.runs) - set(RUNS):
        p.error(f"--runs: unknown {sorted(set(args.runs) - set(RUNS))} (known: {', '.join(RUNS)})")
    args.runs = list(dict.fromkeys(r for name in args.runs for r in (NEEDS.get(name), name) if r))
    args.extra_new_runs = [r.strip() for r in args.extra_new_runs.split(",") if r.strip()] or args.runs
    if set(args.extra_new_runs) - set(args.runs):
        p.error(f"--extra-new-runs: {sorted(set(args.extra_new_runs) - set(args.runs))} not in --runs {args.runs}")
    if args.resume_from and "tiny" not in args.runs:
        p.error("--resume-from compares with NEW's tiny run: --runs must include tiny")
    return args


def compare(args, out: pathlib.Path, made: list) -> dict:
    """The JSON report of `main` (module doc)."""
    revs = {"old": args.old, "new": args.new}
    shas = {side: resolve(rev) for side, rev in revs.items()}
    trees = {side: checkout(rev, made) for side, rev in revs.items()}
    if args.resume_from and args.resume_from not in ("OLD", args.old) and resolve(args.resume_from) != shas["old"]:
        raise SetupError(f"--resume-from={args.resume_from}: only OLD's tiny run is resumed (OLD is {args.old})")
    for side, tree in trees.items():
        print(f"[{side}] {revs[side]} = {shas[side]} imports {check_imports(tree)}", file=sys.stderr)
    report = {"old": shas["old"], "new": shas["new"], "identical": True, "out": str(out), "runs": {},
              "seconds": {"old": {"total": 0.0}, "new": {"total": 0.0}}, "not_compared": list(NOT_COMPARED)}
    for name in args.runs:
        extra = shlex.split(args.extra_new_flags) if name in args.extra_new_runs else []
        r = report["runs"][name] = run_both(name, trees, out, extra, args.hash_arrays, report["seconds"])
        report["identical"] &= r["identical"]
        print(f"{name}: {'identical' if r['identical'] else 'DIFFERENT'} ({r['n_differences']} differences)"
              + (f"; learns: {r['learns']}" if "learns" in r else "")
              + (f"; first: {r['differences'][0]}" if r["differences"] else ""), file=sys.stderr)
    if args.resume_from:
        r = report["resume"] = resume_check(out / "old" / "tiny", trees["new"], out)
        report["identical"] &= r["resumed"]
        print(f"resume: {'resumed' if r['resumed'] else 'FAILED'} at step {r['start_step']}; after step {RESUME_STEP}"
              f" {'identical' if r['identical'] else 'DIFFERENT'} to NEW's own run", file=sys.stderr)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out).resolve() if args.out else pathlib.Path(tempfile.mkdtemp(prefix="compare_out_"))
    made: list[pathlib.Path] = []
    try:
        report = compare(args, out, made)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for tree in made:
            if args.keep:
                print(f"kept worktree {tree}", file=sys.stderr)
            else:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])
                shutil.rmtree(tree.parent, ignore_errors=True)
        if not args.out and not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
