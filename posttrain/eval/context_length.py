"""Effective context length of an evaluation of `<family>@<bucket>` domains (RULER-style).

Accuracy per family and length bucket with Wilson intervals, the effective length relative to the model and RULER's
absolute-threshold figure beside it, a length x evidence-depth heatmap and the paired verdicts grouped by bucket.
The rules and the files: docs/evaluation.md, "Effective context length".
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from typing import Mapping, Sequence

import numpy as np

from posttrain.eval import metrics as metrics_lib

BUCKET = re.compile(r"^(?P<family>.+)@(?P<size>\d+)(?P<unit>[kKM]?)$")
UNITS = {"": 1, "k": 1 << 10, "K": 1 << 10, "M": 1 << 20}
MARGIN, RATIO = 0.10, 0.5  # the relative rule: accuracy >= max(floor + MARGIN, RATIO x the shortest bucket's)
RULER_THRESHOLD = 0.85  # RULER (Hsieh et al. 2024) takes Llama-2-7B's score at 4k, 85.6%; we round it to 0.85
TOLERANCE = 1e-9  # 0.2 + 0.1 > 0.3 in floats: an accuracy equal to its threshold passes
DEPTH_BINS = 5
JSON_FILE, MARKDOWN_FILE, HEATMAP_FILE = "context_length.json", "context_length.md", "context_heatmap.png"
ALL = "all"  # the families pooled


def split_domain(name: str) -> tuple[str, int] | None:
    """(family, bucket tokens) of a `<family>@<bucket>` domain name ("doc@4k" -> ("doc", 4096)); None otherwise."""
    m = BUCKET.match(name)
    return (m["family"], int(m["size"]) * UNITS[m["unit"]]) if m else None


def bucket_label(tokens: int) -> str:
    """The bucket's name: 4096 -> "4k", 1048576 -> "1M", 1000 -> "1000"."""
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if tokens >= size and tokens % size == 0:
            return f"{tokens // size}{unit}"
    return str(tokens)


def has_buckets(domains: Sequence[str]) -> bool:
    """Whether any of the domain names is a `<family>@<bucket>` one."""
    return any(split_domain(d) for d in domains)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of successes / trials (statsmodels' `proportion_confint`); NaNs for no trials."""
    if trials == 0:
        return math.nan, math.nan
    from statsmodels.stats.proportion import proportion_confint

    lo, hi = proportion_confint(successes, trials, alpha=1.0 - confidence, method="wilson")
    return float(lo), float(hi)


def relative_threshold(accuracy: Mapping[int, float], floor: float = 0.0) -> float:
    """max(floor + MARGIN, RATIO x the shortest bucket's accuracy); ValueError for no bucket."""
    if not accuracy:
        raise ValueError("relative_threshold of no bucket")
    return max(floor + MARGIN, RATIO * accuracy[min(accuracy)])


def longest_at_least(accuracy: Mapping[int, float], threshold: float) -> int | None:
    """The longest bucket (tokens) whose accuracy is >= `threshold`, shorter ones failing or not; None if none."""
    passing = [t for t, a in accuracy.items() if a >= threshold - TOLERANCE]
    return max(passing) if passing else None


def relative_effective_length(accuracy: Mapping[int, float], floor: float = 0.0) -> int | None:
    """The effective length relative to the model: `longest_at_least` of `relative_threshold`."""
    return longest_at_least(accuracy, relative_threshold(accuracy, floor))


def ruler_effective_length(accuracy: Mapping[int, float], threshold: float = RULER_THRESHOLD) -> int | None:
    """RULER's figure: the longest bucket whose accuracy is >= an absolute `threshold`."""
    return longest_at_least(accuracy, threshold)


def bucket_counts(records: Sequence[Mapping]) -> dict[str, dict[int, dict]]:
    """{family: {bucket tokens: {"tasks", "correct", "samples", "floor"}}} of the scored samples, buckets ascending.

    "floor": the domain's gaming floor its records carry, None when unknown."""
    kept, _ = metrics_lib.scored_only(records)
    out: dict[str, dict[int, dict]] = {}
    for domain, rs in metrics_lib.by_domain(kept).items():
        parsed = split_domain(domain)
        if parsed is None:
            continue
        correct = np.concatenate([metrics_lib.correct_of(r) for r in rs])
        floors = [float(r["floor"]) for r in rs if r.get("floor") is not None]
        out.setdefault(parsed[0], {})[parsed[1]] = {"tasks": len(rs), "correct": int(correct.sum()),
                                                    "samples": int(correct.size),
                                                    "floor": max(floors) if floors else None}
    return {family: dict(sorted(rows.items())) for family, rows in sorted(out.items())}


def pooled_counts(by_family: Mapping[str, Mapping[int, Mapping]]) -> dict[int, dict]:
    """The families' counts summed per bucket; the floor is their sample-weighted mean (unknown: 0)."""
    out: dict[int, dict] = {}
    for rows in by_family.values():
        for tokens, c in rows.items():
            o = out.setdefault(tokens, {"tasks": 0, "correct": 0, "samples": 0, "floor": 0.0})
            o["floor"] += (c["floor"] or 0.0) * c["samples"]
            for key in ("tasks", "correct", "samples"):
                o[key] += c[key]
    for o in out.values():
        o["floor"] = o["floor"] / o["samples"] if o["samples"] else 0.0
    return dict(sorted(out.items()))


def length_summary(counts: Mapping[int, Mapping], *, ruler_threshold: float = RULER_THRESHOLD,
                   confidence: float = 0.95) -> dict:
    """One family's buckets (accuracy, Wilson interval) and its effective lengths under both rules.

    Args:
      counts: {bucket tokens: {"tasks", "correct", "samples", "floor"}} (`bucket_counts`); the family's floor is
        the largest known one (0 when none is).

    Returns:
      {"floor", "threshold", "effective_tokens", "effective_bucket", "ruler_tokens", "ruler_bucket",
      "below_threshold" (buckets shorter than the effective length that fail its threshold), "buckets": [rows]}.
    """
    floor = max([c["floor"] for c in counts.values() if c["floor"] is not None], default=0.0)
    accuracy = {t: c["correct"] / c["samples"] for t, c in counts.items() if c["samples"]}
    rows = [{"bucket": bucket_label(t), "tokens": t, **c, "accuracy": accuracy.get(t),
             "ci": list(wilson_interval(c["correct"], c["samples"], confidence))} for t, c in counts.items()]
    if not accuracy:
        return {"floor": floor, "threshold": None, "effective_tokens": None, "effective_bucket": None,
                "ruler_tokens": None, "ruler_bucket": None, "below_threshold": [], "buckets": rows}
    threshold = relative_threshold(accuracy, floor)
    effective, ruler = longest_at_least(accuracy, threshold), ruler_effective_length(accuracy, ruler_threshold)
    below = [bucket_label(t) for t, a in accuracy.items() if effective and t < effective and a < threshold - TOLERANCE]
    return {"floor": floor, "threshold": threshold, "effective_tokens": effective,
            "effective_bucket": bucket_label(effective) if effective else None, "ruler_tokens": ruler,
            "ruler_bucket": bucket_label(ruler) if ruler else None, "below_threshold": below, "buckets": rows}


def verdicts_by_bucket(comparison: Mapping) -> dict[str, dict]:
    """The comparison's (`report.comparison_dict`) pass@1 verdicts of `<family>@<bucket>` domains grouped by bucket.

    Returns:
      {bucket: {"counts": {verdict: domains}, "families": {family: {"verdict", "diff", "ci", "p_holm"}}}}, buckets
      ascending."""
    grouped: dict[int, dict] = {}
    for row in comparison["domains"]:
        parsed = split_domain(row["domain"])
        if parsed is None:
            continue
        p1 = row["pass@1"]
        entry = grouped.setdefault(parsed[1], {"counts": {}, "families": {}})
        entry["counts"][row["verdict"]] = entry["counts"].get(row["verdict"], 0) + 1
        entry["families"][parsed[0]] = {"verdict": row["verdict"], "diff": p1["diff"], "ci": list(p1["ci"]),
                                        "p_holm": p1["p_holm"]}
    return {bucket_label(t): grouped[t] for t in sorted(grouped)}


def context_length_dict(evaluations: Mapping[str, Mapping], skipped: Mapping[str, str],
                        comparison: Mapping | None = None, *, ruler_threshold: float = RULER_THRESHOLD,
                        confidence: float = 0.95) -> dict:
    """The report (context_length.json) of evaluations {role: {"records", "label", "step", ...}}.

    Per role: each family's and the pooled ("all") `length_summary`; the skipped `@bucket` domains with their
    reasons; and, given a comparison, `verdicts_by_bucket`."""
    out = {"rule": f"longest bucket with accuracy >= max(floor + {MARGIN:g}, {RATIO:g} x the shortest bucket's "
                   "accuracy)", "ruler_rule": f"longest bucket with accuracy >= {ruler_threshold:g}",
           "ruler_threshold": ruler_threshold, "confidence": confidence, "evaluations": {},
           "skipped": {d: why for d, why in skipped.items() if split_domain(d)}, "heatmap": HEATMAP_FILE}
    for role, ev in evaluations.items():
        counts = bucket_counts(ev["records"])
        families = {f: length_summary(c, ruler_threshold=ruler_threshold, confidence=confidence)
                    for f, c in counts.items()}
        families[ALL] = length_summary(pooled_counts(counts), ruler_threshold=ruler_threshold, confidence=confidence)
        out["evaluations"][role] = {"label": ev.get("label"), "step": ev.get("step"), "families": families}
    if comparison is not None:
        out["verdicts"] = verdicts_by_bucket(comparison)
    return out


def depth_table(records: Sequence[Mapping], bins: int = DEPTH_BINS) -> dict[str, tuple[list[int], np.ndarray,
                                                                                        np.ndarray]]:
    """{family and "all": (buckets, correct, samples)}: [bins, buckets] counts by the records' evidence depth.

    Depth bin i holds depths in [i / bins, (i + 1) / bins) (1.0 in the last); records without "depth" are left out."""
    kept, _ = metrics_lib.scored_only(records)
    cells = [(split_domain(r["domain"]), min(int(float(r["depth"]) * bins), bins - 1), metrics_lib.correct_of(r))
             for r in kept if r.get("depth") is not None and split_domain(r["domain"])]
    out = {}
    for family in sorted({p[0] for p, _, _ in cells}) + [ALL]:
        mine = [(p[1], b, c) for p, b, c in cells if family in (ALL, p[0])]
        buckets = sorted({t for t, _, _ in mine})
        correct, samples = np.zeros((bins, len(buckets))), np.zeros((bins, len(buckets)))
        for t, b, c in mine:
            correct[b, buckets.index(t)] += c.sum()
            samples[b, buckets.index(t)] += c.size
        out[family] = (buckets, correct, samples)
    return out


def heatmap(records: Sequence[Mapping], path: str | pathlib.Path, bins: int = DEPTH_BINS) -> pathlib.Path:
    """Writes a PNG of accuracy per (length bucket, evidence depth bin), a panel per family and all; returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    table = depth_table(records, bins) or {ALL: ([], np.zeros((bins, 0)), np.zeros((bins, 0)))}
    fig = Figure(figsize=(3.2 * len(table) + 1.0, 3.6))
    FigureCanvasAgg(fig)
    image = None
    for i, (family, (buckets, correct, samples)) in enumerate(table.items()):
        ax = fig.add_subplot(1, len(table), i + 1)
        if not buckets:
            ax.text(0.5, 0.5, "no evidence depth in the records", ha="center", va="center", fontsize="small")
            ax.set_axis_off()
            continue
        accuracy = np.divide(correct, samples, out=np.full_like(correct, np.nan), where=samples > 0)
        image = ax.imshow(np.ma.masked_invalid(accuracy), origin="lower", aspect="auto", vmin=0.0, vmax=1.0,
                          cmap="viridis")
        for (b, j), n in np.ndenumerate(samples):
            if n:
                ax.text(j, b, f"{accuracy[b, j]:.2f}\nn={int(n)}", ha="center", va="center", fontsize="xx-small",
                        color="white" if accuracy[b, j] < 0.6 else "black")
        ax.set_xticks(range(len(buckets)))
        ax.set_xticklabels([bucket_label(t) for t in buckets], fontsize="small")
        ax.set_yticks(range(bins))
        ax.set_yticklabels([f"{b / bins:.1f}-{(b + 1) / bins:.1f}" if i == 0 else "" for b in range(bins)],
                           fontsize="small")
        ax.set_facecolor("lightgray")  # a cell without tasks
        ax.set_title(family, fontsize="small")
        ax.set_xlabel("prompt tokens")
        if i == 0:
            ax.set_ylabel("evidence depth")
    if image is not None:
        fig.colorbar(image, ax=fig.axes, label="accuracy")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def context_length_markdown(report: Mapping) -> str:
    """Markdown of a `context_length_dict`: a table per evaluation, the verdicts per bucket, the skipped buckets."""
    pct = f"{100 * report['confidence']:g}%"
    lines = [f"Effective context length: relative = {report['rule']}; RULER = {report['ruler_rule']}. "
             f"Cells: accuracy [{pct} Wilson interval].", ""]
    skipped_at: dict[str, set[int]] = {ALL: set()}
    for family, t in filter(None, map(split_domain, report["skipped"])):
        skipped_at.setdefault(family, set()).add(t)
        skipped_at[ALL].add(t)
    for role, ev in report["evaluations"].items():
        tokens = sorted({row["tokens"] for s in ev["families"].values() for row in s["buckets"]} | skipped_at[ALL])
        lines += [f"{role}: {ev['label']} (step {ev['step']})", "",
                  "| family | " + " | ".join(bucket_label(t) for t in tokens) + " | effective (relative) | RULER |",
                  "|---|" + "---|" * len(tokens) + "---|---|"]
        for family, s in ev["families"].items():
            cells = {row["tokens"]: _cell(row) for row in s["buckets"]}
            gaps = f" (below at {', '.join(s['below_threshold'])})" if s["below_threshold"] else ""
            threshold = "-" if s["threshold"] is None else f"{s['threshold']:.2f}"
            row = [cells.get(t, "skipped" if t in skipped_at.get(family, ()) else "-") for t in tokens]
            lines.append(f"| {family} | " + " | ".join(row) + f" | {s['effective_bucket'] or 'none'} (>= {threshold})"
                         f"{gaps} | {s['ruler_bucket'] or 'none'} |")
        lines.append("")
    if report.get("verdicts"):
        lines += ["Paired verdicts on pass@1 by bucket (candidate - baseline):", "", "| bucket | verdicts | counts |",
                  "|---|---|---|"]
        for bucket, v in report["verdicts"].items():
            each = ", ".join(f"{f} {e['verdict']} ({e['diff']:+.3f})" for f, e in v["families"].items())
            lines.append(f"| {bucket} | {each} | " + ", ".join(f"{k} {n}" for k, n in v["counts"].items()) + " |")
        lines.append("")
    if report["skipped"]:
        lines.append("Skipped: " + "; ".join(f"{d} ({why})" for d, why in report["skipped"].items()))
    return "\n".join(lines).rstrip("\n") + "\n"


def _cell(row: Mapping) -> str:
    if row["accuracy"] is None:
        return "unscored"
    return f"{row['accuracy']:.2f} [{row['ci'][0]:.2f}, {row['ci'][1]:.2f}]"


def write_context_report(folder: str | pathlib.Path, evaluations: Mapping[str, Mapping], skipped: Mapping[str, str],
                         comparison: Mapping | None = None) -> str:
    """Writes context_length.json, context_length.md and context_heatmap.png (the candidate's) into `folder`.

    Args:
      evaluations: {role: evaluation} with a "candidate" (`gate_hook.evaluation`); comparison: the paired
        comparison's dict (`report.comparison_dict`) or None. Returns the Markdown."""
    folder = pathlib.Path(folder)
    report = context_length_dict(evaluations, skipped, comparison)
    (folder / JSON_FILE).write_text(json.dumps(report, indent=2))
    text = context_length_markdown(report)
    (folder / MARKDOWN_FILE).write_text(text)
    heatmap(evaluations["candidate"]["records"], folder / HEATMAP_FILE)
    return text
