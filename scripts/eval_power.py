"""False alarms and power of the evaluation gate's verdicts on a real checkpoint (issue 22, acceptance 3).

    .venv/bin/python scripts/eval_power.py --checkpoint=runs/quickstart [--domains=arithmetic] [--tasks=200]
        [--seeds=20] [--temperature=1.0] [--plant=arithmetic] [--pool=DIR] [--out=DIR] [--json]
    .venv/bin/python scripts/eval_power.py --quick --json      (seconds: configs/tiny.py's initial policy)

One sampling pass draws N = 2 x seeds samples of every task of the selected suite domains with the checkpoint's
policy (at --temperature, the suite's token budgets and scorers) and writes it as a pool (records.jsonl,
results.json) under --out; --pool=DIR reads such a pool back instead of sampling. `posttrain.eval.power` then splits
it into seed pairs (samples 2s and 2s + 1: two independent sampling runs of the same checkpoint that share no
sample) and measures
  - the A/A false-alarm rate: verdicts other than "no change" over domain x seed pairs (the suite's alpha, Holm
    across the domains, exactly as the gate and `posttrain eval --baseline` decide);
  - the detection rate of a planted regression: the --plant domain's replies in the second run of every pair
    replaced by --plant_reply (a constant wrong answer) and rescored through the env (`records.rescore`, the
    `posttrain eval --from_records` path; no sampling again), detected when the domain's verdict is "regressed".
Prints a Markdown summary and, with --json, one JSON line last. The acceptance asks for a false-alarm rate <= 0.05
and a detection rate >= 0.9 over 20 seeds with >= 100 held-out tasks on the trained domain.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICK = {"suite": "configs/eval/tiny.py", "domains": "arithmetic", "tasks": 6, "seeds": 3, "batch_size": 24}
WRONG = "The answer is -987654321."  # no task of the shipped domains has this answer


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="", help="a run's folder (its newest checkpoint); --quick: a tiny one")
    ap.add_argument("--suite", default="configs/eval/default.py")
    ap.add_argument("--domains", default="arithmetic", help="suite domains (names or patterns, comma-separated)")
    ap.add_argument("--tasks", type=int, default=200, help="the first this many tasks of each domain")
    ap.add_argument("--seeds", type=int, default=20, help="seed pairs (the pool has 2 x seeds samples per task)")
    ap.add_argument("--temperature", type=float, default=1.0, help="> 0: A/A needs independent samples")
    ap.add_argument("--plant", default="", help="the domain whose replies are replaced (default: the first "
                                                "trained domain of the selection)")
    ap.add_argument("--plant_reply", default=WRONG)
    ap.add_argument("--batch_size", type=int, default=320, help="samples per sampler call")
    ap.add_argument("--pool", default="", help="a pool folder written before: no sampling")
    ap.add_argument("--out", default="", help="default eval_reports/<run name>/power")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"seconds: {QUICK} on configs/tiny.py's initial policy")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    if args.temperature <= 0 or args.seeds < 1 or args.tasks < 1:
        ap.error(f"need --temperature > 0, --seeds >= 1, --tasks >= 1; got {args.temperature}, {args.seeds}, "
                 f"{args.tasks}")
    if not (args.checkpoint or args.pool or args.quick):
        ap.error("give --checkpoint=RUN (or --pool=DIR, or --quick)")
    return args


def tiny_run(folder: pathlib.Path) -> pathlib.Path:
    """configs/tiny.py's initial policy saved as a step-0 checkpoint in `folder` (no train step compiled)."""
    import importlib.util

    from posttrain.config import from_config_dict
    from posttrain.recipes import grpo
    from posttrain.config.plan import make_run_plan

    spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.train.workdir = str(folder)
    rollouter, learner, _ = grpo.build(make_run_plan(from_config_dict(cfg), workdir=str(folder)))
    learner.save(rollouter.state_dict(), force=True)
    learner.wait()
    learner.close()
    rollouter.close()
    return folder


def sample_pool(args, out: pathlib.Path) -> tuple[list, dict]:
    """Samples the pool (module docstring) and writes it to out/pool; returns (records, results)."""
    from posttrain.eval import records as records_lib, suite as suite_lib
    from posttrain.eval.metrics import task_set_hash
    from posttrain.recipes import evaluate

    suite = suite_lib.select(suite_lib.load_suite(ROOT / args.suite if not pathlib.Path(args.suite).exists()
                                                  else args.suite), limit=args.tasks, domains=args.domains)
    n = 2 * args.seeds
    suite = dataclasses.replace(suite, domains=tuple(dataclasses.replace(d, temperature=args.temperature, n=n, ks=())
                                                     for d in suite.domains))
    plan = evaluate.run_plan_of(args.checkpoint)
    eval_config = dataclasses.replace(plan.config.eval, batch_size=max(n, args.batch_size))
    plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, eval=eval_config))
    built, skipped = suite_lib.resolve(suite)
    if not built:
        raise SystemExit(f"every selected domain was skipped: {skipped}")
    described = suite_lib.suite_dict(suite, built, skipped)
    records, seconds, step = evaluate.evaluate_policies(plan, built, with_base=False)["run"]
    results = {"label": f"{args.checkpoint} pool", "step": step, "task_set_hash": task_set_hash(records),
               "suite": described, "seconds": seconds, "samples_per_task": n, "temperature": args.temperature}
    records_lib.write_evaluation(out / "pool", records, results)
    return records, results


def run(args) -> dict:
    from posttrain.eval import power, records as records_lib

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick and not (args.checkpoint or args.pool):
            args.checkpoint = str(tiny_run(pathlib.Path(tmp) / "tiny"))
        out = pathlib.Path(args.out or (pathlib.Path(tmp) / "power" if args.quick else
                                        pathlib.Path("eval_reports") / pathlib.Path(args.checkpoint or args.pool)
                                        .resolve().name / "power"))
        if args.pool:
            pool, results = records_lib.read_evaluation(args.pool)
        else:
            pool, results = sample_pool(args, out)
        described = results["suite"]
        rows = {row["name"]: row for row in described["domains"]}
        plant = args.plant or next((row["name"] for row in described["domains"] if row["trained"]), "")
        result = power.measure(pool, seeds=args.seeds, alpha=described["alpha"], planted_domain=plant,
                               planted_reply=args.plant_reply, rescore=lambda rs: records_lib.rescore(rs, rows))
    sampled_s = results.get("seconds", {})
    return json.loads(json.dumps({"quick": bool(args.quick), "checkpoint": args.checkpoint, "pool": args.pool or str(out / "pool"),
            "tasks": {d: sum(r["domain"] == d for r in pool) for d in result.domains},
            "samples_per_task": power.pool_size(pool), "temperature": results.get("temperature"),
            **dataclasses.asdict(result), "sample_s": sampled_s.get("total"), "total_s": time.perf_counter() - t0,
            "pool_pass_at_1": {d: sum(sum(r["correct"]) / len(r["correct"]) for r in pool if r["domain"] == d) /
                               max(1, sum(r["domain"] == d for r in pool)) for d in result.domains}}))


def markdown(out: dict) -> str:
    lines = [f"pool: {out['pool']} ({out['samples_per_task']} samples per task at T={out['temperature']}, "
             f"sampled in {out['sample_s'] or 0:.0f} s)", "",
             "| domain | tasks | pool pass@1 | A/A false alarms (seeds) | A/A diff range |", "|---|---|---|---|---|"]
    for d in out["domains"]:
        diffs = out["aa_pass_at_1"][d]
        lines.append(f"| {d} | {out['tasks'][d]} | {out['pool_pass_at_1'][d]:.3f} | "
                     f"{len(out['false_alarms'][d])} {out['false_alarms'][d]} | {min(diffs):+.3f} .. {max(diffs):+.3f} |")
    lines += ["", f"A/A false-alarm rate: {out['false_alarm_rate']:.3f} of {len(out['domains']) * out['seeds']} "
                  f"domain x seed pairs (acceptance: <= 0.05)"]
    if out["planted_domain"]:
        lines.append(f"planted regression on {out['planted_domain']}: detected in {len(out['detected'])} of "
                     f"{out['seeds']} seeds, rate {out['detection_rate']:.3f} (acceptance: >= 0.9); planted pass@1 "
                     f"{min(out['planted_pass_at_1']):.3f} .. {max(out['planted_pass_at_1']):.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = run(args)
    print(markdown(out))
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
