"""`bench/rollout.py --multi_turn N`: multi-turn episodes through the engine per episode vs today's sampler turn by turn.

    python bench/rollout.py --multi_turn 4 [--model smollm2-135m] [--episodes 16] [--reply 32] [--bridge 16]
                            [--prompt-len 64] [--env-latency 0.05] [--overlap 3] [--page-size 16] [--runs 3]
    python bench/rollout.py --multi_turn 3 --quick     # seconds: `QUICK` (tiny-dense, 4 episodes)

Workload (issue 25 item 7): E episodes of N turns on a preset's random weights (float32, as --lengths long_tail).
Each starts from --prompt-len random token ids (seed 0); each turn's reply has its own budget, drawn uniformly
from --reply * [1 - --spread, 1 + --spread] (seed 0; greedy, no stop ids, so a reply is exactly its budget, as
replies of different lengths are); after it the env sleeps --env-latency seconds (one env worker: one step at a time) and appends --bridge
random tokens (its observation and the template's), so turn t + 1's context = turn t's + reply + bridge.
  * sampler: today's path (`episodes.run_episodes` with the dense sampler): every turn, one
    `generate.sampler.sample` call over all E contexts (right-padded to a multiple of 16, the whole context
    prefilled again) to the turn's largest budget (a call ends with its slowest row), each reply cut to its
    budget, then every episode's env step.
  * engine_full_table: the engine per episode (`rollout.per_episode`'s scheduling: a reply that ends steps its
    env in `on_finish` and queues its next turn, which prefills only the new tokens) with E slots holding every
    episode at its longest, and every decode step given the whole page table (the engine before
    `EngineSettings.table_width`);
  * engine: the same with the page table as wide as the longest live sequence;
  * engine_overlap: the same with the env on a thread of its own, each next turn queued --overlap decode steps
    after its reply ended (`sampling.engine_env_overlap`).
One warm-up call per side (compiles) is timed apart; then the sides alternate for --runs rounds; medians reported.
Prints ONE JSON object: each side's generated tokens/s (the budgets' sum / median round seconds), the ratios of the
engine sides to the sampler, env seconds per round (E * N * latency, what the overlap can hide), how many episodes'
greedy tokens agree with the sampler's, per-round seconds and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from _helpers import parse_quick
from _rollout_long_tail import random_weights
from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample

QUICK = {"model": "tiny-dense", "episodes": 4, "reply": 4, "bridge": 3, "prompt_len": 8, "env_latency": 0.005,
         "overlap": 2, "page_size": 4, "runs": 1}
BUCKET = 16


def parse_args(argv=None) -> argparse.Namespace:
    """Command line (`QUICK` fills what --quick leaves unset). Raises SystemExit on bad values."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--multi_turn", type=int, required=True, help="turns per episode (N >= 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    ap.add_argument("--model", default="smollm2-135m", help="a posttrain.model.presets name (random weights)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--reply", type=int, default=32, help="tokens of every reply")
    ap.add_argument("--spread", type=float, default=0.5, help="reply budgets: reply * [1 - spread, 1 + spread]")
    ap.add_argument("--bridge", type=int, default=16, help="tokens the env and template add after a reply")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--env-latency", type=float, default=0.05, help="seconds of one env step")
    ap.add_argument("--overlap", type=int, default=3, help="decode steps an env step may overlap")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    args = parse_quick(ap, argv, QUICK)
    if min(args.episodes, args.reply, args.bridge, args.prompt_len, args.page_size, args.runs, args.overlap) < 1 \
            or args.multi_turn < 2 or args.env_latency < 0 or not 0 <= args.spread < 1:
        raise SystemExit("--multi_turn must be >= 2, --episodes --reply --bridge --prompt-len --page-size --runs "
                         f"--overlap >= 1, --env-latency >= 0 and --spread in [0, 1) (got {vars(args)})")
    return args


def workload(args, vocab: int):
    """(prompts [E] lists, bridges [E][N - 1] lists, budgets [E][N]): random ids >= 4, seed 0."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, vocab, args.prompt_len).tolist() for _ in range(args.episodes)]
    bridges = [[rng.integers(4, vocab, args.bridge).tolist() for _ in range(args.multi_turn - 1)]
               for _ in range(args.episodes)]
    lo, hi = max(1, round(args.reply * (1 - args.spread))), round(args.reply * (1 + args.spread))
    budgets = rng.integers(lo, hi + 1, (args.episodes, args.multi_turn)).tolist()
    return prompts, bridges, budgets


def longest(args) -> int:
    """The longest episode's context: prompt + N replies at the largest budget + N - 1 bridges (+ 1 bridge)."""
    return args.prompt_len + args.multi_turn * (round(args.reply * (1 + args.spread)) + args.bridge)


def run_sampler(graphdef, state, args, prompts, bridges, budgets) -> list[list[int]]:
    """Turn by turn: one sampler call over every context, then every env step. Returns each episode's replies."""
    contexts, replies = [list(p) for p in prompts], [[] for _ in prompts]
    for turn in range(args.multi_turn):
        params = SamplingParams(max_new_tokens=max(b[turn] for b in budgets), temperature=0.0)
        tokens, lengths = pad_prompts(contexts, 0, bucket=BUCKET)
        res = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), group_size=1,
                     params=params, stop_ids=(), pad_id=0)
        out = np.asarray(res.tokens_NxLg)
        for i in range(len(contexts)):
            time.sleep(args.env_latency)
            reply = out[i, :budgets[i][turn]].tolist()
            replies[i] += reply
            if turn < args.multi_turn - 1:
                contexts[i] += reply + bridges[i][turn]
    return replies


def run_engine(engine, args, prompts, bridges, budgets, overlap: int) -> list[list[int]]:
    """Per episode: each reply's env step in on_finish (overlap 0) or on a thread (overlap > 0)."""
    owner, turn_of = list(range(len(prompts))), [0] * len(prompts)
    contexts, replies = [list(p) for p in prompts], [[] for _ in prompts]

    def request(i, turn=0):
        return Request(prompt=tuple(contexts[i]), max_new_tokens=budgets[i][turn], temperature=0.0)

    def next_turn(i, turn, reply):
        time.sleep(args.env_latency)
        if turn >= args.multi_turn:
            return None
        contexts[i] += reply + bridges[i][turn - 1]
        return request(i, turn)

    with ThreadPoolExecutor(1) as pool:
        def on_finish(index, c):
            i, turn, reply = owner[index], turn_of[index] + 1, c.tokens.tolist()
            replies[i] += reply
            if not overlap:
                nxt = next_turn(i, turn, reply)
                if nxt is None:
                    return None
            owner.append(i)
            turn_of.append(turn)
            return nxt if not overlap else pool.submit(next_turn, i, turn, reply)

        engine.clear_cache()
        engine.generate([request(i) for i in range(len(prompts))], jax.random.key(0), on_finish=on_finish,
                        follow_after=overlap)
    return replies


def main(argv=None) -> dict:
    """Runs the benchmark (see the module doc); prints and returns its JSON."""
    args = parse_args(argv)
    cfg, graphdef, state = random_weights(args.model)
    prompts, bridges, budgets = workload(args, cfg.vocab_size)
    width = longest(args)
    settings = EngineSettings(num_slots=args.episodes, num_pages=args.episodes * -(-width // args.page_size) + 1,
                              page_size=args.page_size, max_seq_len=width, prefill_bucket=BUCKET)
    engine, full = Engine(graphdef, state, settings), Engine(graphdef, state, settings)
    whole = settings.pages_per_seq

    def run_full():
        real = EngineSettings.table_width
        EngineSettings.table_width = lambda self, pages: whole
        try:
            return run_engine(full, args, prompts, bridges, budgets, 0)
        finally:
            EngineSettings.table_width = real

    sides = {"sampler": lambda: run_sampler(graphdef, state, args, prompts, bridges, budgets),
             "engine_full_table": run_full,
             "engine": lambda: run_engine(engine, args, prompts, bridges, budgets, 0),
             "engine_overlap": lambda: run_engine(engine, args, prompts, bridges, budgets, args.overlap)}
    warm, rounds, outs = {}, {k: [] for k in sides}, {}
    for name, fn in sides.items():
        t = time.perf_counter()
        outs[name] = fn()
        warm[name] = time.perf_counter() - t
    for _ in range(args.runs):
        for name, fn in sides.items():
            t = time.perf_counter()
            fn()
            rounds[name].append(time.perf_counter() - t)
    tokens = int(sum(map(sum, budgets)))
    speed = {k: tokens / statistics.median(v) for k, v in rounds.items()}
    out = {f"{k}_tokens_per_s": v for k, v in speed.items()}
    out.update({f"ratio_{k}": speed[k] / speed["sampler"] for k in sides if k != "sampler"},
               overlap_over_engine=speed["engine_overlap"] / speed["engine"],
               table_width_speedup=speed["engine"] / speed["engine_full_table"],
               env_s_per_round=args.episodes * args.multi_turn * args.env_latency, generated_tokens=tokens,
               agree={k: sum(a == b for a, b in zip(outs["sampler"], outs[k])) for k in sides if k != "sampler"},
               episodes=args.episodes, turns=args.multi_turn, max_seq_len=width, pages_per_seq=whole,
               warmup_s=warm, round_s=rounds, model=args.model, load_avg_1m=os.getloadavg()[0])
    print(json.dumps(out))
    return out
