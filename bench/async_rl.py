"""Asynchronous rollouts vs the synchronous loop (issue 24, acceptance 3): the GRPO loop at rollout.max_staleness=1
with streaming scoring (rollout.stream_chunk) against the same loop at 0 without it (the synchronous loop: peer),
same tasks, seeds and config otherwise, in the same run.

    python bench/async_rl.py --json [--steps 14] [--latency 0.5] [--quickstart-steps 4]
    python bench/async_rl.py --quick        # seconds: `QUICK` (a tiny model, 0.05 s env steps, no quickstart case)

Cases.
  (a) `latency`: an env-latency-bound config: `_latency_env` (Arithmetic-v0 whose every step waits --latency seconds
      in its worker, as a sandboxed test run does), --prompts x --group episodes on --env-workers workers, a small
      random model (BENCH_MODEL) behind a ~330-token system turn (SYSTEM: the sampler prefills it once, the update
      trains it in every row, so the update costs more than the 8-token generation, as with long code prompts).
      The defaults balance the two sides, env (8 episodes / 4 workers x 0.5 s = 1.0 s) against gen + train
      (~1.2 s on 2 cores), so that the bound is near its maximum of 2; with 2 workers env was 2.0 s against
      0.13 s of compute for the earlier 4-layer model, a bound of 1.07 that no overlap can beat.
      Figure: async steps per hour; peer: sync; ratio (target >= 1.5).
  (b) its bound: the terms gen (perf/gen_s), train (perf/train_s) and env (perf/reward_s), medians of the sync run's
      measured steps; bound = (gen + train + env) / max(gen + train, env) (gen and train share the cores, env waits
      do not); share_of_bound = ratio / bound (target >= 0.8).
  (c) `quickstart`: configs/quickstart.py (SmolLM2-135M, 8 x 8 samples of 24 tokens), --quickstart-steps steps
      each, sync vs async (target: async not more than 5% slower, ratio >= 0.95), and `no_stream`: async at
      staleness 1 without streaming scoring (ASYNC_NO_STREAM; its env time is ~0, so streaming only cuts the decode
      into stream_chunk-step calls, which then queue behind the update's work on the shared cores);
      --quickstart-steps 0 skips it.
  `gil_stall` (issue 24 item 5): the learner's update time (the latency case's model and batch) alone and next to
      a producer that runs the rollout phase (`Rollouter.collect`: tasks, tokenizer, batching, archive rows) with a
      scripted sampler (no device work), i.e. blocked on env latency, in three variants (`_gil_stall`): sleep (a
      thread whose env wait is a pure time.sleep), thread (a thread with the env pool: the async loop's model) and
      process (that producer in a child process: the GIL not shared); --gil-rounds rounds of --gil-steps updates
      each, alternating; ratio = median with / median alone per variant (target <= 1.05), gil_part = thread /
      process, core_part = process / alone, and each producer's CPU seconds per batch.
A step's time is the wall time of `GRPOTrainer.step()` (rollout wait, update, archive, metrics); steps per hour is
3600 / the mean over the steps after the first --warmup (their compiles): the mean counts every measured step, as
steps per hour does (a median would drop a later step's recompile); `ratio_of_medians` is reported beside it.
Each case reports the 1-minute load average after it (the shared machine's load moves every figure). Prints ONE
JSON object (--json: only it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH_DIR), BENCH_DIR]  # bench/ too: env workers import _latency_env from it

from _helpers import parse_quick  # noqa: E402

QUICK = dict(steps=3, warmup=1, latency=0.05, prompts=2, group=2, quickstart_steps=0, gil_rounds=1, gil_steps=3,
             model="tiny")
BENCH_MODEL = dict(vocab_size=320, d_model=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536)
ASYNC = {"rollout.max_staleness": 1, "rollout.stream_chunk": 2}
SYNC = {"rollout.max_staleness": 0, "rollout.stream_chunk": 0}
ASYNC_NO_STREAM = {"rollout.max_staleness": 1, "rollout.stream_chunk": 0}
SYSTEM = ("You are a careful assistant that solves arithmetic problems. Read the question, add the two numbers "
          "digit by digit, check the sum once more, and then reply with the final answer only, as a plain number "
          "without words, units or punctuation. Replies that contain anything else are scored as wrong. ")
TERMS = {"gen": "perf/gen_s", "train": "perf/train_s", "env": "perf/reward_s"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--steps", type=int, default=14, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures (compiles)")
    ap.add_argument("--latency", type=float, default=0.5, help="seconds each env step waits in its worker")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--env-workers", type=int, default=4, help="env worker processes (each runs its episodes "
                    "one after another: env seconds per step = episodes / workers x latency)")
    ap.add_argument("--model", choices=["bench", "tiny"], default="bench", help="BENCH_MODEL or tiny-dense")
    ap.add_argument("--quickstart-steps", type=int, default=4, help="steps per quickstart run (0: skip case c)")
    ap.add_argument("--gil-rounds", type=int, default=3, help="rounds of the GIL-stall check (each: alone, then "
                    "each producer variant started afresh)")
    ap.add_argument("--gil-steps", type=int, default=8, help="learner updates timed per variant and round")
    args = parse_quick(ap, argv, QUICK)
    if args.steps <= args.warmup or args.warmup < 0:
        ap.error(f"--steps={args.steps} must exceed --warmup={args.warmup} >= 0")
    if not args.latency >= 0:
        ap.error(f"--latency={args.latency} must be >= 0 seconds")
    return args


def latency_config(args):
    """The latency case's ConfigDict (without the rollout section's settings: SYNC / ASYNC)."""
    from _latency_env import ENV_ID
    from posttrain.config import env_spec
    from posttrain.config.tiny import tiny_base

    c = tiny_base("tiny-dense")
    if args.model == "bench":  # a long shared system turn: prefilled once by the sampler, trained in every row
        c.model.overrides, c.sampling.system_prompt = dict(BENCH_MODEL), SYSTEM
    c.env.train = {"code": env_spec(ENV_ID, split="train", digits=1, num_test=20, latency_s=args.latency)}
    c.env.num_workers = args.env_workers
    c.rl.prompts_per_step, c.rl.group_size = args.prompts, args.group
    c.eval.at_start = c.eval.at_end = False
    c.checkpoint.every_steps, c.checkpoint.async_save = 10_000, False
    c.train.steps = args.steps
    return c


def quickstart_config(args):
    from posttrain.recipes.trainer import load_config_file

    c = load_config_file(os.path.join(os.path.dirname(BENCH_DIR), "configs", "quickstart.py"))
    c.eval.at_start = c.eval.at_end = False
    c.checkpoint.every_steps = 10_000
    c.train.steps = args.quickstart_steps
    return c


def run(cfg, overrides: dict, warmup: int, root: str, name: str, after=None) -> dict:
    """Drives one run step by step: {step_s: mean wall seconds of the steps after `warmup` (steps per hour =
    3600 / step_s), step_s_median, steps_s, terms: medians of TERMS over them, load_avg, staleness_max,
    idle_ratio_train}; `after(trainer)` runs once its steps are done (the producer has stopped), before it closes,
    and its result is kept under "after"."""
    from posttrain import GRPOTrainer

    times, rows, extra = [], [], {}
    with GRPOTrainer.from_config(cfg, workdir=os.path.join(root, name), overrides=overrides) as trainer:
        while not trainer.done:
            t = time.perf_counter()
            rows.append(trainer.step())
            times.append(time.perf_counter() - t)
        if after is not None:
            extra["after"] = after(trainer)
    measured = rows[warmup:]
    terms = {k: statistics.median(r.get(key, 0.0) for r in measured) for k, key in TERMS.items()}
    return {"step_s": round(statistics.fmean(times[warmup:]), 4),
            "step_s_median": round(statistics.median(times[warmup:]), 4), "steps_s": [round(t, 3) for t in times],
            "terms_s": {k: round(v, 4) for k, v in terms.items()}, "load_avg": os.getloadavg()[0],
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
            "idle_ratio_train": round(statistics.median(r.get("perf/idle_ratio_train", 0.0) for r in measured), 3),
            **extra}


def compare(cfg, warmup: int, root: str, name: str, after=None, no_stream: bool = False) -> dict:
    """The sync run (peer; `after` as `run`'s) then the async one, same config and seeds: steps per hour, ratio,
    bound, share; with `no_stream` also async without streaming scoring ("no_stream": its run and ratio)."""
    sync = run(cfg, SYNC, warmup, root, f"{name}_sync", after)
    asyn = run(cfg, ASYNC, warmup, root, f"{name}_async")
    t = sync["terms_s"]
    bound = (t["gen"] + t["train"] + t["env"]) / max(t["gen"] + t["train"], t["env"], 1e-9)
    ratio = sync["step_s"] / asyn["step_s"]
    ratio_median = sync["step_s_median"] / asyn["step_s_median"]
    out = {"sync": sync, "async": asyn, "sync_steps_per_hour": round(3600 / sync["step_s"], 1),
           "async_steps_per_hour": round(3600 / asyn["step_s"], 1), "ratio": round(ratio, 3),
           "ratio_of_medians": round(ratio_median, 3), "bound": round(bound, 3),
           "share_of_bound": round(ratio / bound, 3)}
    if no_stream:
        plain = run(cfg, ASYNC_NO_STREAM, warmup, root, f"{name}_async_no_stream")
        out["no_stream"] = {**plain, "ratio": round(sync["step_s"] / plain["step_s"], 3)}
    return out


def gil_stall(args):
    """`after` hook of the latency case's sync run: the learner's update seconds alone vs next to a producer blocked
    on env latency, per variant (`_gil_stall.measure`), on a batch of that run (its compiled programs)."""
    import jax

    import _gil_stall

    def measure(trainer) -> dict:
        from posttrain.infra.partitioning import use_rules

        with use_rules(trainer.plan.rules):  # as the run's own steps traced them
            learner, rollouter = trainer._loop.learner, trainer._loop.rollouter
            batch = rollouter.collect(trainer.global_step, learner.policy(), learner.rng).batch

            def timed() -> float:
                t = time.perf_counter()
                learner.update(batch)
                jax.block_until_ready(learner.state)
                return time.perf_counter() - t

            timed()  # warm (the run's step compiled it: same shapes)
            return _gil_stall.measure(timed, rollouter, rounds=args.gil_rounds, steps=args.gil_steps,
                                      latency_s=args.latency)

    return measure


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="async_rl_") as root:
        latency = compare(latency_config(args), args.warmup, root, "latency", after=gil_stall(args))
        gil = latency["sync"].pop("after")
        quick = (compare(quickstart_config(args), 1, root, "quickstart", no_stream=True)
                 if args.quickstart_steps > 1 else {"skipped": "--quickstart-steps < 2"})
    out = {"async_steps_per_hour": latency["async_steps_per_hour"],
           "sync_steps_per_hour": latency["sync_steps_per_hour"], "ratio": latency["ratio"],
           "bound": latency["bound"], "share_of_bound": latency["share_of_bound"], "latency": latency,
           "gil_stall": gil, "quickstart": quick,
           "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "sync": SYNC, "async": ASYNC,
                        "async_no_stream": ASYNC_NO_STREAM,
                        "cpus": os.cpu_count()}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
