"""Overlap of the shipped training configs' train tasks with the shipped evaluation suites' tasks.

For every (training domain, suite domain) pair: rows found by `envs.tasks.overlap.contamination` (exact, 13-gram,
near-duplicate), the rule `posttrain tasks check` applies to task files. Prints a Markdown table and one JSON line.

  python scripts/overlap_shipped.py [--max_rows=2000] [--configs=quickstart,gsm8k,...] [--suites=default,...]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ("quickstart", "gsm8k", "humaneval", "reasoning_mix", "tool", "repo_fix")
SUITES = ("default", "reasoning_mix", "agentic")
KINDS = ("exact", "ngram", "near_duplicate")


def train_rows(config: str, max_rows: int, gsm8k: str) -> dict[str, list[tuple[str, str]]]:
    """{config/domain: [(id, prompt)]} of the first `max_rows` train tasks of each env.train entry of a config
    (GSM8K-v0 entries without a path read `gsm8k`)."""
    import dataclasses

    from posttrain.config import from_config_dict
    from posttrain.recipes.trainer import load_config_file
    from posttrain.rollout.env_side import task_sources

    cfg = from_config_dict(load_config_file(str(ROOT / "configs" / f"{config}.py")))
    out = {}
    for name, spec in cfg.env.train.items():
        if spec.id == "posttrain/GSM8K-v0" and not spec.kwargs.get("path") and gsm8k:
            spec = dataclasses.replace(spec, kwargs={**dict(spec.kwargs), "path": gsm8k})
        try:
            _, _, source = task_sources({name: spec})[name]
        except Exception as e:  # noqa: BLE001 - data absent on this machine: the pair is reported as skipped
            print(f"skipped {config}/{name}: {' '.join(str(e).split())[:160]}", file=sys.stderr)
            continue
        rows = []
        for i in range(min(source.num_tasks, max_rows)):
            task = source.get_task(i)
            text = task.get("question") if isinstance(task.get("question"), str) else task.get("prompt")
            if isinstance(text, str):
                rows.append((str(task.get("id", i)), text))
        out[f"{config}/{name}"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_rows", type=int, default=2000)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--gsm8k", default=str(ROOT.parent / "shared" / "data" / "gsm8k"),
                        help="GSM8K JSONL folder for configs that leave its path empty")
    args = parser.parse_args()
    from envs.tasks import overlap
    from posttrain.eval import suite as suite_lib

    t0 = time.perf_counter()
    train = {}
    for config in args.configs.split(","):
        train.update(train_rows(config.strip(), args.max_rows, args.gsm8k))
    reference = {}
    for name in args.suites.split(","):
        reference.update(suite_lib.suite_prompts(suite_lib.load_suite(ROOT / "configs" / "eval" / f"{name.strip()}.py")))
    pairs = []
    for t_name, t_rows in train.items():
        for r_name, r_rows in reference.items():
            found = overlap.contamination(t_rows, r_rows)
            kinds = collections.Counter(o.kind for o in found)
            pairs.append({"train": t_name, "train_rows": len(t_rows), "suite": r_name, "suite_rows": len(r_rows),
                          "rows": len({o.a for o in found}), **{k: kinds.get(k, 0) for k in KINDS}})
    print("| train domain | rows | suite domain | rows | train rows overlapping | exact | 13-gram | near-dup |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for p in pairs:
        if p["rows"]:
            print(f"| {p['train']} | {p['train_rows']} | {p['suite']} | {p['suite_rows']} | {p['rows']} | "
                  f"{p['exact']} | {p['ngram']} | {p['near_duplicate']} |")
    clean = sum(not p["rows"] for p in pairs)
    print(f"\n{len(pairs)} pairs ({len(train)} train domains x {len(reference)} suite domains), {clean} without "
          f"overlap; {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"pairs": pairs, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
