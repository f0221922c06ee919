"""Verifier benchmark: time to score long responses of adversarial shapes (issue 13 item 5; docs/design.md
invariant 14).

    python bench/verifiers.py --json [--repeats N]
    python bench/verifiers.py --json --quick     # seconds: responses of `QUICK_SIZES` characters, one repeat

For each shape (spaces, tabs, digits, commas, nested braces, repeated ``\\text{``, ...; the same shapes as
tests/envs/test_verifiers.py) builds a 100 KB and a 1 MB response and times `envs.verify.answers.score_math`
against gold "42" (best of --repeats). Also times one warm symbolic comparison through the worker pool
and one call that has to be cut off by the time bound.

Prints ONE JSON object: per shape {"ms_100k", "ms_1m", "ratio"}, "max_ms_1m", "goal_ms_1m" (50), "ratio_to_goal"
(max_ms_1m / goal_ms_1m: below 1 meets it), "symbolic_warm_ms", "timeout_call_s" (with timeout_s=1) and the
1-minute load average. With --quick the sizes are `QUICK_SIZES` (the keys keep their names).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from _helpers import parse_quick  # noqa: E402
from envs.verify import answers  # noqa: E402

SIZES = (100_000, 1_000_000)  # characters of the "100k" and "1m" responses
QUICK_SIZES = (1_000, 10_000)  # --quick

SHAPES = {
    "spaces": lambda n: "#### 1" + " " * n + "x", "tabs": lambda n: "\t" * n + "7", "digits": lambda n: "1" * n,
    "commas": lambda n: "1," * (n // 2), "braces": lambda n: r"\boxed{" + "{" * (n // 2) + "}" * (n // 2) + "}",
    "text": lambda n: r"\boxed{5" + r"\text{" * (n // 6) + "}", "hashes": lambda n: "#### " * (n // 5),
    "boxes": lambda n: r"\boxed{1}" * (n // 9), "unit_tail": lambda n: "#### 5" + " " * n + r"\text{ cm}",
    "unicode": lambda n: "\u2212\u2009" * (n // 2) + "\uff17", "think": lambda n: "<think>" + "9 " * (n // 2),
}


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats per input (best is reported)")
    args = parse_quick(ap, argv, {"repeats": 1}, help=f"seconds: sizes {QUICK_SIZES}, one repeat unless given")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    sizes = QUICK_SIZES if args.quick else SIZES
    out: dict = {"sizes": list(sizes), "quick": args.quick, "shapes": {}}
    for name, make in SHAPES.items():
        small, big = make(sizes[0]), make(sizes[1])
        ms_small = best_ms(lambda: answers.score_math(small, "42"), args.repeats)
        ms_big = best_ms(lambda: answers.score_math(big, "42"), args.repeats)
        out["shapes"][name] = {"ms_100k": round(ms_small, 3), "ms_1m": round(ms_big, 3),
                               "ratio": round(ms_big / max(ms_small, 1e-3), 2)}
    out["max_ms_1m"] = max(s["ms_1m"] for s in out["shapes"].values())
    out["goal_ms_1m"] = 50
    out["ratio_to_goal"] = round(out["max_ms_1m"] / out["goal_ms_1m"], 3)
    answers.answers_equivalent("1", "1+0")  # start a worker
    out["symbolic_warm_ms"] = round(best_ms(lambda: answers.answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}"),
                                            args.repeats), 2)
    t0 = time.perf_counter()
    verdict = answers.score_math(r"\boxed{\binom{1000000000}{100000000}}", "1", timeout_s=1.0)
    out["timeout_call_s"] = round(time.perf_counter() - t0, 3)
    out["timeout_call_status"] = verdict.status
    out["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
