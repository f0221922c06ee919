"""`posttrain status`: the run view per domain, read only (nothing in the run folder is created or changed).

  posttrain status --workdir=RUN [--json]   (per domain: weight, priority, share and quota used (last step / run),
                   episodes, pass rate, infra errors, retries, quarantined, breaker, curriculum level)"""
from __future__ import annotations

import json
import pathlib
import sys

# column -> (header, format of a value); None prints as "-"
_FORMATS = {"domain": ("domain", "{}"), "weight": ("weight", "{:.3g}"), "priority": ("prio", "{}"),
            "share_last": ("share last", "{:.1%}"), "share_run": ("share run", "{:.1%}"),
            "quota_last": ("quota last", "{:.1%}"), "quota_run": ("quota run", "{:.1%}"),
            "episodes": ("episodes", "{}"), "pass_rate": ("pass rate", "{:.1%}"),
            "infra_errors": ("infra err", "{}"), "retries": ("retries", "{}"), "quarantined": ("quarant.", "{}"),
            "breaker": ("breaker", "{}"), "level": ("level", "{}")}


def _pass_threshold(workdir: pathlib.Path) -> float:
    path = workdir / "config.json"
    if not path.is_file():
        return 1.0
    return float(json.loads(path.read_text()).get("tasks", {}).get("pass_threshold", 1.0))


def load_view(workdir) -> dict:
    """{"step", "source", "rows"} of the run in `workdir` (`status_table.rows`), read only; `step` as metrics.jsonl.

    From status.json, the episode archive filling what it lacks (a pass: reward >= tasks.pass_threshold). Raises
    FileNotFoundError naming the folder without either, ValueError for an offline run."""
    from posttrain.scheduling import archive, status_table

    workdir = pathlib.Path(workdir)
    status = status_table.read_status(workdir)
    needs_archive = status is None or any("run" not in d for d in status.get("domains", {}).values())
    stats = None
    if needs_archive and archive.step_files(workdir):
        table = archive.read(workdir, columns=status_table.ARCHIVE_COLUMNS)
        stats = status_table.archive_stats(table, _pass_threshold(workdir))
    if status is None and stats is None:
        if workdir.is_dir():  # what kind of run it is, when there is one to read (posttrain.runs loads JAX)
            from posttrain.runs import read as read_run

            kind = read_run.run_kind(workdir)
        else:
            kind = None
        if kind is not None and kind in read_run.OFFLINE_KINDS:
            raise ValueError(f"--workdir={workdir} is {read_run.KIND_NAMES[kind]}: status shows a GRPO run's task "
                             f"scheduling per domain (status.json, archive/); {kind} has none (its metrics: "
                             f"{workdir / 'metrics.jsonl'}, {workdir / 'summary.json'})")
        what = "no such directory" if not workdir.is_dir() else "neither status.json nor archive/step_*.parquet in it"
        raise FileNotFoundError(f"--workdir={workdir}: {what}; --workdir names the folder of a run (e.g. "
                                "runs/quickstart)")
    source = "+".join(s for s, v in (("status.json", status), ("archive", stats)) if v is not None)
    last = (status or {}).get("step", (stats or {}).get("step"))
    return {"step": None if last is None else int(last) + 1, "source": source, "rows": status_table.rows(status, stats)}


def _cells(row: dict) -> list[str]:
    return ["-" if row[k] is None else fmt.format(row[k]) for k, (_, fmt) in _FORMATS.items()]


def render_text(data: dict) -> str:
    """The view as a plain-text table (fixed-width columns)."""
    table = [[h for h, _ in _FORMATS.values()]] + [_cells(r) for r in data["rows"]]
    widths = [max(len(r[i]) for r in table) for i in range(len(_FORMATS))]
    lines = [f"step {data['step']} ({data['source']})"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in table]
    return "\n".join(lines)


def _print_rich(data: dict) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(title=f"step {data['step']} ({data['source']})")
    for i, (header, _) in enumerate(_FORMATS.values()):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in data["rows"]:
        table.add_row(*_cells(row))
    Console().print(table)
    return True


def cmd_status(f) -> int:
    if not f.workdir:
        print("error: status needs --workdir=RUN (the folder of a run)", file=sys.stderr)
        return 2
    try:
        data = load_view(f.workdir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if f.json:
        print(json.dumps(data))
    elif not (sys.stdout.isatty() and _print_rich(data)):
        print(render_text(data))
    return 0
