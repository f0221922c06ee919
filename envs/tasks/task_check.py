"""`posttrain tasks check`: a task file checked before training (schema, golden answers, gaming floor, duplicates,
contamination, token lengths), each failing check naming its rows. The rules: docs/task_checks.md. No JAX.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from envs.tasks import overlap, probes, task_file

CHECKS = ("schema", "golden", "floor", "duplicate", "near_duplicate", "contamination")
FLOOR_THRESHOLD = 0.2  # the gaming floor from which a file fails (as `envs.tasks.floors.FLOOR_THRESHOLD`)
SHOWN_IDS = 10  # row ids named per finding in the table (the JSON has them all)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One failed check of a file: which check, the rows it names (ids or file:line) and what is wrong."""

    check: str
    rows: tuple[str, ...]
    message: str


@dataclasses.dataclass
class FileReport:
    """What `check_file` found in one file.

    Attributes:
      path: the file; rows: rows read (valid ones); splits: {"train": n, "test": n}.
      findings: the failed checks (empty: the file passes).
      floor: the gaming floor (best probe's mean reward on test rows) and its probe; None when not measured.
      lengths: token-length statistics of the rendered prompts ({min, median, p95, max}); None without a tokenizer.
    """

    path: str
    rows: int = 0
    splits: dict[str, int] = dataclasses.field(default_factory=dict)
    findings: list[Finding] = dataclasses.field(default_factory=list)
    floor: float | None = None
    probe: str = ""
    lengths: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return not self.findings

    def flagged(self) -> set[str]:
        """Every row id a finding names in this file."""
        return {r for f in self.findings for r in f.rows}


def _texts(tasks: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(id, variable text) of each task: the prompt itself, without template or system prompt."""
    return [(t["id"], t["question"]) for t in tasks]


def check_file(path: str, *, reference: Mapping[str, Sequence[tuple[str, str]]] | None = None,
               tokenizer: Any = None, probe_tasks: int = 100, threshold: float = FLOOR_THRESHOLD,
               **settings: Any) -> tuple[FileReport, list[dict]]:
    """The checks of one task file, and its valid rows (for cross-file contamination).

    Args:
      path: the task file; settings: the other `TaskFileSettings` fields (fields, answer_after, verifier, ...).
      reference: {source name: [(id, prompt text)]} the file must not overlap (eval suites' prompts, other files).
      tokenizer: with `encode(str) -> list[int]`, for prompt token lengths (None: not measured).
      probe_tasks: rows per split scored by each gaming probe.
      threshold: the gaming floor from which the file fails.
    Raises FileNotFoundError, or TaskFileError for a file that cannot be read at all (bad settings: ValueError).
    """
    settings = task_file.TaskFileSettings(path=path, **{**settings, "split": "all"})
    try:
        tasks, errors = task_file.scan(settings)
    except task_file.TaskFileError as e:  # a file that cannot be read at all (not UTF-8, not Parquet): its fault
        report = FileReport(path)
        report.findings.append(Finding("schema", (path,), " ".join(str(e).split())))
        return report, []
    report = FileReport(path, len(tasks), {s: sum(t["split"] == s for t in tasks) for s in ("train", "test")})
    add = report.findings.append
    for where, problem in errors:  # one finding a row: the JSON has every reason
        add(Finding("schema", (where,), f"{where}: {problem}"))
    if not tasks:
        if not errors:
            add(Finding("schema", (path,), f"{path}: no rows (an empty file, or a CSV header alone)"))
        return report, tasks
    for i, where, reward, why in task_file.golden_failures(tasks):
        add(Finding("golden", (i,), f"{i} ({where}): its reference answer scores {reward:g} through its own "
                    f"verifiers: {why}"))
    if len(tasks) >= 2:
        a = probes.assess_task_file(dataclasses.asdict(settings) | {"verifier": _spec_list(settings)},
                                    tasks=probe_tasks)
        report.floor, report.probe = a.floor, a.probe
        if a.floor is not None and a.floor >= threshold:
            gamed = _solved_by(a.probe, tasks, probe_tasks)
            add(Finding("floor", gamed, f"a reply without a solution earns {a.floor:.2f} mean reward (>= "
                        f"{threshold:g}): probe {a.probe!r} solves {len(gamed)} of {len(tasks)} rows"))
    for o in overlap.exact_duplicates(_texts(tasks)):
        add(Finding("duplicate", (o.a, o.b), f"{o.a} repeats {o.b}"))
    for o in overlap.near_duplicates(_texts(tasks)):
        add(Finding("near_duplicate", (o.a, o.b), f"{o.a} nearly repeats {o.b} (similarity {o.score:.2f})"))
    for source, rows in (reference or {}).items():
        for o in overlap.contamination(_texts(tasks), rows):
            add(Finding("contamination", (o.a,), f"{o.a} overlaps {source} {o.b} ({o.kind}, {o.score:.2f}"
                        f"{': ' + o.detail if o.detail else ''})"))
    if tokenizer is not None:
        lengths = sorted(len(tokenizer.encode(task_file.render_prompt(t, settings.template))) for t in tasks)
        report.lengths = {"min": lengths[0], "median": statistics.median(lengths),
                          "p95": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))], "max": lengths[-1]}
    return report, tasks


def _spec_list(settings: task_file.TaskFileSettings) -> list[dict]:
    return [{"name": s.name, **dict(s.args), "weight": s.weight} for s in settings.verifier]


def _solved_by(probe: str, tasks: Sequence[Mapping[str, Any]], limit: int) -> tuple[str, ...]:
    """The ids of the rows (of the first `limit` per split) the named probe's reply solves."""
    train, test, replies = probes.task_file_probes(list(tasks), limit)  # the probes the floor was measured with
    make = replies.get(probe)
    if make is None:
        return ()
    return tuple(t["id"] for t in train + test if task_file.score_task(t, make(t))[0] >= 1.0)


def check_files(paths: Sequence[str], *, reference: Mapping[str, Sequence[tuple[str, str]]] | None = None,
                tokenizer: Any = None, probe_tasks: int = 100, **settings: Any) -> list[FileReport]:
    """`check_file` of each path, each also checked against the files before it (contamination between files).

    A file that cannot be read at all is that file's schema finding; the other files are still checked."""
    reports, seen = [], {}
    for path in paths:
        report, tasks = check_file(path, reference={**(reference or {}), **seen}, tokenizer=tokenizer,
                                   probe_tasks=probe_tasks, **settings)
        reports.append(report)
        seen[path] = _texts(tasks)
    return reports


def to_json(reports: Sequence[FileReport]) -> dict:
    """The reports as one JSON-able dict: {"ok", "files": [...]}, every finding with all its rows."""
    return {"ok": all(r.ok for r in reports), "files": [
        {"path": r.path, "ok": r.ok, "rows": r.rows, "splits": r.splits, "flagged_rows": len(r.flagged()),
         "floor": r.floor, "probe": r.probe, "lengths": r.lengths,
         "findings": [dataclasses.asdict(f) for f in r.findings]} for r in reports]}


def format_report(reports: Sequence[FileReport]) -> str:
    """The table `posttrain tasks check` prints: a block per file, a line per check with the rows it names."""
    lines = []
    for r in reports:
        lines.append(f"{r.path}: {r.rows} rows ({r.splits.get('train', 0)} train, {r.splits.get('test', 0)} test), "
                     f"{'PASS' if r.ok else 'FAIL'}")
        floor = "not measured" if r.floor is None else f"{r.floor:.2f} ({r.probe})"
        by_check = {c: [f for f in r.findings if f.check == c] for c in CHECKS}
        for check in CHECKS:
            found = by_check[check]
            extra = f", floor {floor}" if check == "floor" else ""
            if not found:
                lines.append(f"  {check:<15} ok{extra}")
                continue
            rows = list(dict.fromkeys(x for f in found for x in f.rows))
            shown = ", ".join(rows[:SHOWN_IDS]) + (f" (+{len(rows) - SHOWN_IDS} more)" if len(rows) > SHOWN_IDS else "")
            lines.append(f"  {check:<15} FAIL{extra}: {len(found)} finding(s), rows {shown}")
            for f in found[:3]:
                lines.append(f"  {'':<15}   {f.message[:300]}")
            if len(found) > 3:
                lines.append(f"  {'':<15}   ... {len(found) - 3} more (--json lists every finding)")
        if r.lengths:
            lines.append("  {:<15} prompt tokens min {min} median {median:g} p95 {p95} max {max}".format(
                "lengths", **r.lengths))
    failed = sum(not r.ok for r in reports)
    lines.append(f"{len(reports)} file(s), {failed} failed")
    return "\n".join(lines)


def dumps(reports: Sequence[FileReport]) -> str:
    """`to_json` as one line."""
    return json.dumps(to_json(reports), default=str)
