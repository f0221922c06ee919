"""Output of a `posttrain.eval.compare.Comparison`: a Markdown table, a JSON-able dict, a PNG forest plot.

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from posttrain.eval.compare import Comparison, VERDICTS

VERDICT_COLORS = {"improved": "tab:green", "no change": "tab:gray", "regressed": "tab:red"}


def comparison_dict(cmp: Comparison) -> dict:
    """The comparison as a JSON-able dict: settings, "domains" (both metrics each), "counts", "unscored_domains"."""
    domains = []
    for d in cmp.domains:
        row = {"domain": d.domain, "tasks": d.tasks, "unscored": d.unscored, "wins": d.wins, "losses": d.losses,
               "partial_credit": d.partial_credit, "verdict": d.verdict}
        for m in (d.pass_at_1, d.mean_reward):
            entry = dataclasses.asdict(m)
            entry["ci"] = list(entry["ci"])
            row[entry.pop("metric")] = entry
        domains.append(row)
    counts = {v: sum(d.verdict == v for d in cmp.domains) for v in VERDICTS}
    return {"task_set_hash": cmp.task_set_hash, "alpha": cmp.alpha, "confidence": cmp.confidence,
            "power": cmp.power, "n_resamples": cmp.n_resamples, "seed": cmp.seed, "tasks": sum(d.tasks for d in cmp.domains),
            "domains": domains, "counts": counts, "unscored_domains": list(cmp.unscored_domains)}


def comparison_markdown(cmp: Comparison) -> str:
    """A Markdown table, a row per domain (pass@1 with interval, p-values, MDE, verdicts), then what was unscored."""
    pct = f"{100 * cmp.confidence:g}%"
    lines = [
        f"Paired comparison (candidate - baseline) over {sum(d.tasks for d in cmp.domains)} tasks in "
        f"{len(cmp.domains)} domains; alpha = {cmp.alpha:g} (Holm across domains), {pct} paired bootstrap "
        f"intervals, MDE at power {cmp.power:g}; task set {cmp.task_set_hash[:12]}",
        "",
        f"| domain | tasks | pass@1 base | pass@1 cand | diff [{pct} CI] | wins/losses | test | p | p (Holm) | MDE "
        "| verdict | reward diff [CI] | reward verdict |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|---|---|",
    ]
    for d in cmp.domains:
        p1, rw = d.pass_at_1, d.mean_reward
        lines.append(
            f"| {d.domain} | {d.tasks} | {p1.baseline:.3f} | {p1.candidate:.3f} | {_diff_ci(p1)} | {d.wins}/{d.losses} "
            f"| {p1.test} | {_p(p1.p)} | {_p(p1.p_holm)} | {_mde(p1.mde)} | **{p1.verdict}** | {_diff_ci(rw)} "
            f"| {rw.verdict or '-'} |")
    left_out = [f"{d.domain}: {d.unscored} task(s)" for d in cmp.domains if d.unscored]
    left_out += [f"{d}: every task (not tested)" for d in cmp.unscored_domains]
    if left_out:
        lines += ["", "Left out of the pairs (a side has no scored sample: every one ended in infra_error, the env "
                      "or its sandbox failed): " + "; ".join(left_out)]
    return "\n".join(lines) + "\n"


def _mde(mde: float) -> str:
    """The MDE cell; above 1, which no pass@1 difference reaches, nothing is detectable."""
    return f"{mde:.3f}" if mde <= 1 else f"{mde:.3f} (none detectable: add tasks)"


SUMMARY_COLUMNS = ("pass@1", "mean_reward", "above_floor", "format_rate", "mean_length", "truncation_rate",
                   "modal_share", "gold_modal_share")


def summary_markdown(summary: dict, label: str = "") -> str:
    """A Markdown table of one evaluation (`runner.suite_summary`): a row per area and its domains, then all tasks."""
    order = []
    for area, s in summary["areas"].items():
        order.append((f"**{area}**", s))
        order += [(f"- {d}" + (" COLLAPSED" if ds.get("collapsed") else "")
                   + (" UNSCORED" if ds.get("unscored_tasks") and not ds["tasks"] else ""), ds)
                  for d, ds in summary["domains"].items() if summary["area_of"].get(d) == area]
    order.append(("**all**", summary["all"]))
    ks = sorted({k for _, s in order for k in s if k.startswith("pass@") and k != "pass@1"}, key=lambda k: int(k[5:]))
    cols = ["pass@1", *ks, *SUMMARY_COLUMNS[1:]]
    infra = any(s.get("infra_errors") for _, s in order)
    extra = " infra errors (tasks unscored) |" if infra else ""
    lines = ([label, ""] if label else []) + ["| area / domain | tasks | n | " + " | ".join(cols) + " |" + extra,
                                              "|---|---:|---:|" + "---:|" * (len(cols) + infra)]
    for name, s in order:
        cells = ["-" if c not in s else f"{s[c]:.1f}" if c == "mean_length" else f"{s[c]:.3f}" for c in cols]
        if infra:
            cells.append(f"{s.get('infra_errors', 0)} ({s.get('unscored_tasks', 0)})")
        lines.append(f"| {name} | {int(s['tasks'])} | {int(s['n_min'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def forest_plot(cmp: Comparison, path: str | Path, *, metric: str = "pass@1") -> Path:
    """Writes a PNG forest plot of `metric`'s differences and intervals, a line per domain; returns the path.

    Thick: the family-wise interval (`MetricComparison.ci_adjusted`, Bonferroni over the domains tested); thin:
    the unadjusted interval. The colour and the label at the right of each row are the verdict and its Holm-adjusted
    p-value: the test decides, and a bootstrap interval of few discordant tasks can exclude 0 where the exact test
    does not. A comparison written before adjusted intervals existed draws the unadjusted one, marked so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if metric not in ("pass@1", "mean_reward"):
        raise ValueError(f"forest_plot metric must be 'pass@1' or 'mean_reward', got {metric!r}")
    if not cmp.domains:
        raise ValueError("forest_plot of a comparison with no domains")
    rows = [(d.domain, d.tasks, d.pass_at_1 if metric == "pass@1" else d.mean_reward) for d in cmp.domains]
    fig = Figure(figsize=(8.5, 1.4 + 0.4 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    adjusted = all(m.ci_adjusted is not None for _, _, m in rows)
    for i, (_, _, m) in enumerate(reversed(rows)):
        color = VERDICT_COLORS.get(m.verdict or "no change")
        ax.plot([m.ci[0], m.ci[1]], [i, i], color=color, linewidth=1 if adjusted else 2)
        if adjusted:
            ax.plot([m.ci_adjusted[0], m.ci_adjusted[1]], [i, i], color=color, linewidth=4, alpha=0.6)
        ax.plot([m.diff], [i], "o", color=color)
        if m.p_holm is not None:  # the test that decides, beside the interval that may not agree with it
            ax.annotate(f"{m.verdict}, Holm p={m.p_holm:.2g}", (1.0, i), xycoords=("axes fraction", "data"),
                        xytext=(-4, 6), textcoords="offset points", ha="right", fontsize="x-small", color=color)
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{name} (T={t})" for name, t, _ in reversed(rows)])
    m = len(rows)
    ax.set_xlabel(f"{metric} difference, candidate - baseline\n" + (
        f"thick: family-wise {100 * (1 - cmp.alpha / m):.4g}% CI (Bonferroni over {m}); thin: unadjusted "
        f"{100 * cmp.confidence:g}%" if adjusted else f"UNADJUSTED {100 * cmp.confidence:g}% paired bootstrap CI"))
    ax.set_title(f"alpha = {cmp.alpha:g}, Holm across {len(rows)} domains")
    for verdict_name, color in VERDICT_COLORS.items():
        ax.plot([], [], "o", color=color, label=verdict_name)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: never over a row
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _diff_ci(m) -> str:
    return f"{m.diff:+.3f} [{m.ci[0]:+.3f}, {m.ci[1]:+.3f}]"


def _p(p: float | None) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "-"
    return f"{p:.3g}"
