"""Run the accepted/refused reply tables of tests/envs/verify/test_named.py and print them as a Markdown table.

    .venv/bin/python scripts/verifier_table.py [--repeat=3]

One line per table row: verifier, reply (shortened), expected and measured reward, status and milliseconds (the
slowest of --repeat runs); a summary line with the worst case and the machine follows. docs/verifiers.md shows the
output under "Accepted and refused replies (measured)".
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_tables():
    """The test module (its TABLES and run_case), loaded from its file."""
    spec = importlib.util.spec_from_file_location("test_named", ROOT / "tests" / "envs" / "verify" / "test_named.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def escape(text: str) -> str:
    """`text` safe in a Markdown table cell (pipes and backticks escaped)."""
    return text.replace("|", "\\|").replace("`", "\\`")


def shorten(reply, limit: int = 36) -> str:
    """A table cell for a reply: its repr, cut to `limit` chars with the length added when longer."""
    if not isinstance(reply, str):
        return escape(f"{type(reply).__name__} {reply!r:.20}")
    return escape(f"{reply[:limit]!r}... ({len(reply):,} chars)" if len(reply) > limit else repr(reply))


def spec_text(spec) -> str:
    """The verifier's name, with the arguments a table row sets (patterns and schemas left out)."""
    if isinstance(spec, str):
        return spec
    args = [f"{k}={v!r}" for k, v in spec.items() if k not in ("name", "pattern", "schema")]
    args += ["schema"] if "schema" in spec else []
    return f"{spec['name']} ({', '.join(args)})" if args else spec["name"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the slowest is shown")
    args = parser.parse_args(argv)
    tests = load_tables()
    print("| verifier | reply (shortened) | what it shows | expected | got | status | ms |")
    print("|---|---|---|---|---|---|---|")
    worst, mismatches = (0.0, ""), 0
    for name, table in tests.TABLES.items():
        for case in table:
            runs = [tests.run_case(case) for _ in range(args.repeat)]
            scored, seconds = runs[0][0], max(s for _, s in runs)
            got = scored.verdict.reward
            mismatches += got != case.expected
            print(f"| {escape(spec_text(case.spec))} | {shorten(case.reply)} | {escape(case.note)} | "
                  f"{case.expected:g} | {got:g} | {scored.verdict.status} | {seconds * 1000:.1f} |")
            worst = max(worst, (seconds * 1000, f"{name}: {case.note}"))
    print(f"\nWorst case {worst[0]:.0f} ms ({worst[1]}); {mismatches} rows differ from the expected reward. "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
