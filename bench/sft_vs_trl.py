"""One SFT setting, two trainers: posttrain's `posttrain sft` recipe vs TRL's `SFTTrainer`, seconds per step and
peak memory on this CPU (the setting, the data and how each figure is measured: bench/_offline_vs_trl.py).

    python bench/sft_vs_trl.py --json            # SmolLM2-135M-Instruct (the default GGUF), 8 rows x 4 steps (minutes)
    python bench/sft_vs_trl.py --json --quick    # seconds: a tiny random preset, 2 rows x 2 steps

Prints one JSON object: posttrain_step_s, trl_step_s, ratio (posttrain / TRL: below 1 is faster), peak RSS of
each side and peak_memory_ratio, tokens_per_step of each side, the settings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import _offline_vs_trl as common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command line. Raises SystemExit (argparse) on bad values, e.g. --steps < 2."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one line of JSON (else indented)")
    ap.add_argument("--quick", action="store_true", help="seconds: a tiny random preset, 2 rows x 2 steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per side, the first one a warm-up (default 4; "
                    "--quick 2)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per side")
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 4)
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (one warm-up, one timed), got {a.steps}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.side:
        return common.child(a.side, a.spec)
    out = common.compare(os.path.abspath(__file__), "sft", a.quick, a.steps, a.timeout)
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
