"""`posttrain eval --suite`: an evaluation suite on a run's newest checkpoint, against a baseline, paired by task.

    posttrain eval --suite=configs/eval/default.py --checkpoint=runs/quickstart [--baseline=base|RUN2]
                   [--limit=N] [--domains=PATTERNS] [--out=DIR] [--config=configs/X.py --config.eval.seed=S]
    posttrain eval --from_records=DIR [--suite=...] [--out=DIR]      (rescore recorded replies, no sampling)

The suite (`posttrain.eval.suite`) is resolved once (skipped domains listed with their reasons); each policy
samples every domain with the domain's n, temperature, token budget and turns, the run's system prompt, prompt
bucket and eval batch size, and the key `eval.seed` (the candidate run's config; the baseline uses the same stream,
so the same policy twice gives the same samples and a new seed gives an independent evaluation). "base" is the
run's initial policy (before its first update). The comparison (`posttrain.eval.compare`, at the suite's alpha) is
written as Markdown, JSON and a PNG forest plot (`posttrain.eval.report`).

Output folder (--out, default `eval_reports/<run name>/<suite name>-step<N>` under the current directory, N the
evaluated checkpoint's step; the run's folder is only read, as `lm_eval --output_path` writes beside, never into,
the model it reads): suite.json; candidate/ and baseline/ (records.jsonl, results.json: task_set_hash, summary,
step, seconds by domain); comparison.md, comparison.json, forest.png.
"""
from __future__ import annotations

import json
import pathlib
import time
from typing import Mapping

from posttrain.config import Config
from posttrain.eval import compare as compare_lib
from posttrain.eval import records as records_lib
from posttrain.eval import report, suite as suite_lib
from posttrain.infra.partitioning import use_rules
from posttrain.recipes import grpo, read_run
from posttrain.recipes.eval_gate import evaluation as _evaluation, sample_suite
from posttrain.recipes.run_plan import RunPlan, make_run_plan


def run_plan_of(checkpoint: str | pathlib.Path, cfg: Config | None = None, flag: str = "--checkpoint") -> RunPlan:
    """The run plan for the run in `checkpoint`, of any kind (`read_run.reading_config`: its saved config.json,
    or `cfg` (a --config) with the run's own model sections), with its workdir. Raises RunNotFoundError (nothing
    read or created; naming `flag`) without a complete checkpoint there, ConfigError for a run it cannot evaluate."""
    grpo.require_checkpoint(checkpoint, flag)
    return make_run_plan(read_run.reading_config(checkpoint, cfg, "eval --suite", suite=True), workdir=str(checkpoint))


def evaluate_policies(plan: RunPlan, built, *, with_base: bool, sampling_plan: RunPlan | None = None) -> dict:
    """{"base"?: (records, seconds, 0), "run": (records, seconds, step)}: the run's initial policy (when
    `with_base`) and its newest checkpoint, sampled with `sampling_plan`'s eval settings (default: `plan`'s). Only
    the suite's envs (`built`) are used: the run's own env.train and env.eval are not built, so a run trained on an
    env whose module is not importable here evaluates on a suite all the same."""
    out = {}
    with use_rules(plan.rules):
        rollouter, learner, _ = grpo.build(plan, reading=True, restore=False, held_out=False)
        try:
            if with_base:
                out["base"] = (*sample_suite(sampling_plan or plan, built, rollouter, learner.policy()), 0)
            learner.restore()
            out["run"] = (*sample_suite(sampling_plan or plan, built, rollouter, learner.policy()), learner.step)
        finally:
            learner.close()
            rollouter.close()
    return out


def write_report(out: pathlib.Path, evaluations: Mapping[str, dict], alpha: float, skipped: Mapping[str, str]) -> str:
    """Writes each evaluation's folder and, with a baseline, the comparison files; returns the printed text."""
    texts = []
    for role, ev in evaluations.items():
        records_lib.write_evaluation(out / role, ev["records"], {k: v for k, v in ev.items() if k != "records"})
        by_domain = ", ".join(f"{d} {s:.0f}" for d, s in ev["seconds"].items() if d != "total")
        texts.append(report.summary_markdown(ev["summary"], f"{role}: {ev['label']} (step {ev['step']}), "
                                             f"{ev['perf/eval_s']:.0f} s" + (f" ({by_domain})" if by_domain else "")))
    if skipped:
        texts.append("skipped: " + "; ".join(f"{d} ({why})" for d, why in skipped.items()) + "\n")
    if "baseline" in evaluations:
        cmp = compare_lib.compare(evaluations["baseline"], evaluations["candidate"], alpha=alpha)
        md = report.comparison_markdown(cmp)
        (out / "comparison.md").write_text(md)
        (out / "comparison.json").write_text(json.dumps(report.comparison_dict(cmp), indent=2))
        report.forest_plot(cmp, out / "forest.png")
        mdes = sorted(d.pass_at_1.mde for d in cmp.domains)
        texts += [md, f"suite size: {sum(d.tasks for d in cmp.domains)} tasks in {len(cmp.domains)} domains; "
                      f"minimum detectable effect on pass@1 (power {cmp.power:g}, alpha {alpha:g}/{len(mdes)}): "
                      f"{mdes[0]:.3f} to {mdes[-1]:.3f} by domain (median {mdes[len(mdes) // 2]:.3f})\n"]
    return "\n".join(texts)


def evaluate_suite(suite_path: str, checkpoint: str, *, baseline: str | None = None, cfg: Config | None = None,
                   limit: int | None = None, domains: str | None = None, out: str | None = None) -> dict:
    """Runs the suite on `checkpoint` (and `baseline`: "base" or a run's workdir), writes the report (see the
    module docstring); returns as `_result`. Raises RunNotFoundError
    for a run without a complete checkpoint, ValueError for a malformed suite or selection."""
    suite = suite_lib.select(suite_lib.load_suite(suite_path), limit=limit, domains=domains)
    plan = run_plan_of(checkpoint, cfg)
    base_plan = run_plan_of(baseline, flag="--baseline") if baseline not in (None, "base") else None
    built, skipped = suite_lib.resolve(suite)
    if not built:
        raise ValueError(f"suite {suite.name!r}: every domain was skipped: {skipped}")
    described = suite_lib.suite_dict(suite, built, skipped)
    ks = {r.domain.name: r.domain.ks for r in built}
    ran = evaluate_policies(plan, built, with_base=baseline == "base")
    evaluations = {"candidate": _evaluation(str(checkpoint), *ran["run"], ks, described)}
    if baseline == "base":
        evaluations["baseline"] = _evaluation("base", *ran["base"], ks, described)
    elif base_plan is not None:
        other = evaluate_policies(base_plan, built, with_base=False, sampling_plan=plan)["run"]
        evaluations["baseline"] = _evaluation(str(baseline), *other, ks, described)
    evaluations = dict(sorted(evaluations.items()))  # baseline first
    folder = pathlib.Path(out) if out else default_out(checkpoint, suite.name, evaluations["candidate"]["step"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "suite.json").write_text(json.dumps(described, indent=2))
    text = write_report(folder, evaluations, suite.alpha, skipped)
    return _result(folder, text, evaluations, skipped)


def default_out(checkpoint, suite_name: str, step: int) -> pathlib.Path:
    """The default report folder: eval_reports/<run name>/<suite name>-step<step> under the current directory
    (outside the run: a command that reads a run never writes into it)."""
    return pathlib.Path("eval_reports") / pathlib.Path(checkpoint).resolve().name / f"{suite_name}-step{step}"


def _result(folder, text, evaluations, skipped) -> dict:
    """{"out", "text", "skipped", "task_set_hash", "unscored", "counts"?}: "unscored" = {role: [domain]} of the
    domains no task of which was scored in that evaluation (every sample an infra_error), empty roles left out."""
    unscored = {role: [d for d, s in ev["summary"]["domains"].items() if s.get("unscored_tasks") and not s["tasks"]]
                for role, ev in evaluations.items()}
    result = {"out": str(folder), "text": text, "skipped": dict(skipped),
              "task_set_hash": evaluations["candidate"]["task_set_hash"],
              "unscored": {role: ds for role, ds in unscored.items() if ds}}
    if (folder / "comparison.json").is_file():
        result["counts"] = json.loads((folder / "comparison.json").read_text())["counts"]
    return result


def rescore_folder(folder: str, *, suite_path: str | None = None, out: str | None = None) -> dict:
    """Rescores a report folder (baseline/ and candidate/) or one evaluation folder without sampling
    (`posttrain.eval.records.rescore`), with the scorers and formats of `suite_path` where given (else those
    recorded), and writes the rebuilt report to `out` (default <folder>/rescored). Returns as `evaluate_suite`."""
    folder = pathlib.Path(folder)
    roles = [r for r in ("baseline", "candidate") if (folder / r).is_dir()] or [None]
    overrides = ({d.name: d for d in suite_lib.load_suite(suite_path).domains} if suite_path else {})
    evaluations, described, alpha = {}, {}, 0.05
    for role in roles:
        records, results = records_lib.read_evaluation(folder / role if role else folder)
        described, alpha = results["suite"], results["suite"].get("alpha", alpha)
        specs = {row["name"]: {**row, **({"scorer": overrides[row["name"]].scorer,
                                          "format": overrides[row["name"]].format} if row["name"] in overrides else {})}
                 for row in described["domains"]}
        t0 = time.perf_counter()
        rescored = records_lib.rescore(records, specs)
        ks = {name: tuple(row.get("ks", ())) for name, row in specs.items()}
        evaluations[role or "candidate"] = _evaluation(results["label"], rescored,
                                                       {"total": time.perf_counter() - t0}, results.get("step"), ks,
                                                       described)
    target = pathlib.Path(out) if out else folder / "rescored"
    target.mkdir(parents=True, exist_ok=True)
    text = write_report(target, evaluations, alpha, described.get("skipped", {}))
    return _result(target, text, evaluations, described.get("skipped", {}))
