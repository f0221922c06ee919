"""`bench/rollout.py --lengths long_tail`: the paged continuous-batching engine vs today's sampler at equal KV memory.

    python bench/rollout.py --lengths long_tail [--model smollm2-135m] [--requests 64] [--slots 16] [--short 16]
                            [--long-factor 8] [--prompt-len 32] [--page-size 16] [--runs 3] [--skip-transformers]
                            [--decode-chunk K[,K...]]
    python bench/rollout.py --lengths long_tail --quick     # seconds: `QUICK` (tiny-dense, 12 requests, 4 slots)

Workload (issue 25 item 7): R requests of --prompt-len random token ids (seed 0) whose replies are 90% short
(--short tokens) and 10% --long-factor times longer, greedy, no stop ids (each reply is exactly its budget), on a
preset's random weights (float32, NumPy normal(0, 0.02), norm scales ones; the SmolLM2-135M shapes by default).
  * engine: `posttrain.generate.engine.loop.Engine` with S = --slots slots and all R requests queued; each request has
    its own budget; a finished slot is refilled at once.
  * sampler: `posttrain.generate.sampler.sample` on the same requests in calls of S rows (request order), each call
    with the largest budget among its rows (one token budget per call), every row decoded to it.
  * transformers (the peer, unless --skip-transformers): the same weights written as an HF directory
    (`checkpoints.export.export_hf`) and loaded by `transformers.AutoModelForCausalLM` (float32, the CPU,
    --torch-threads threads, default torch's own; --quick: 1), `generate(do_sample=False)` on the same requests
    in calls of S rows like the sampler, each call to its rows' largest budget (`min_new_tokens` =
    `max_new_tokens`: no early stop), its dense KV cache.
Equal KV memory: a sampler call holds S rows of (padded prompt + longest budget) tokens per layer; the engine's
pool holds the same number of tokens in pages (plus the scratch page); both byte counts are in the JSON.
Only each request's own budget counts as generated tokens on both sides (what a caller asked for). One warm-up
call per side (compiles) is timed apart; then the sides alternate for --runs rounds; medians are reported.
Prints ONE JSON object: engine_tokens_per_s, sampler_tokens_per_s, ratio (engine / sampler), transformers_tokens_per_s
and ratio_transformers (engine / transformers), the engine's rollout/* metrics, its pages at peak
(peak_pages: allocated, used, allocated - used, live sequences then, and the largest (allocated - used) / live over
all steps: at most 1 page per live sequence by construction), the requests whose greedy tokens agree with the
engine's on each other side, KV bytes, per-round seconds and the 1-minute load average; decode_chunk (K of the
first engine) and engine_by_chunk (per --decode-chunk value, as resolved: tokens/s, agreement with the first
engine, slot occupancy, warm-up seconds); with --profile, `profile.<side>`: one more call of each side under
jax.profiler (bench/_profile.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _helpers import INIT_STD, parse_quick, progress
from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer
from posttrain.generate import kv_pages
from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample

QUICK = {"model": "tiny-dense", "requests": 12, "slots": 4, "short": 4, "prompt_len": 8, "page_size": 4,
         "runs": 1, "torch_threads": 1}
PROMPT_BUCKET = 16


def parse_args(argv=None) -> argparse.Namespace:
    """Command line (`QUICK` fills what --quick leaves unset). Raises SystemExit on bad values."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", choices=("long_tail",), required=True)
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    ap.add_argument("--model", default="smollm2-135m", help="a posttrain.model.presets name (random weights)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--short", type=int, default=16, help="tokens of a short reply")
    ap.add_argument("--long-factor", type=int, default=8, help="a long reply is this many short ones")
    ap.add_argument("--long-frac", type=float, default=0.1, help="share of long replies")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true", help="engine and sampler only")
    ap.add_argument("--profile", action="store_true", help="one more engine and sampler call each under "
                                                           "jax.profiler (bench/_profile.py), in 'profile'")
    ap.add_argument("--torch-threads", type=int, default=0, help="transformers' torch threads (0: torch's default)")
    ap.add_argument("--decode-chunk", default="0", help="the engine's decode steps per program "
                    "(EngineSettings.decode_chunk; 0: the backend's default); a comma list times one engine each, "
                    "the first reported as 'engine', all in 'engine_by_chunk'")
    args = parse_quick(ap, argv, QUICK)
    try:
        args.decode_chunk = [int(k) for k in str(args.decode_chunk).split(",")]
    except ValueError:
        raise SystemExit(f"--decode-chunk takes a comma list of integers >= 0, got {args.decode_chunk!r}") from None
    if min(args.decode_chunk) < 0 or len(set(args.decode_chunk)) < len(args.decode_chunk):
        raise SystemExit(f"--decode-chunk takes distinct integers >= 0, got {args.decode_chunk}")
    if min(args.requests, args.slots, args.short, args.long_factor, args.prompt_len, args.page_size, args.runs) < 1 \
            or not 0 <= args.long_frac <= 1:
        raise SystemExit("--requests --slots --short --long-factor --prompt-len --page-size --runs must be >= 1, "
                         f"--long-frac in [0, 1] (got {args.long_frac})")
    return args


def random_weights(name: str, seed: int = 0):
    """(cfg, graphdef, state): preset `name` in float32 with NumPy normal(0, INIT_STD) weights, norm scales ones."""
    cfg = get_preset(name, dtype="float32", param_dtype="float32")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(path, v):
        shape = v.shape
        x = np.ones(shape, np.float32) if "norm" in jax.tree_util.keystr(path) else \
            (INIT_STD * rng.standard_normal(shape, np.float32))
        return v.replace(jnp.asarray(x))

    return cfg, graphdef, jax.tree_util.tree_map_with_path(fill, abstract,
                                                           is_leaf=lambda x: isinstance(x, nnx.Variable))


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, budgets): random prompts (ids >= 4) and round(R * long_frac) long budgets at random places."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
    budgets = np.full(args.requests, args.short)
    budgets[rng.permutation(args.requests)[:round(args.requests * args.long_frac)]] = args.short * args.long_factor
    return prompts, budgets.tolist()


def run_sampler(graphdef, state, prompts, budgets, slots: int) -> list[np.ndarray]:
    """Today's sampler in calls of `slots` rows; each request's tokens cut to its budget."""
    out = []
    for i in range(0, len(prompts), slots):
        tokens, lengths = pad_prompts(prompts[i:i + slots], 0, bucket=PROMPT_BUCKET)
        params = SamplingParams(max_new_tokens=max(budgets[i:i + slots]), temperature=0.0)
        res = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), group_size=1,
                     params=params, stop_ids=(), pad_id=0)
        toks = np.asarray(res.tokens_NxLg)
        out += [toks[j, :b] for j, b in enumerate(budgets[i:i + slots])]
    return out


class TransformersSide:
    """transformers' `generate` on the same weights and requests, in calls of `slots` rows (see the module doc)."""

    def __init__(self, cfg, state, prompts, budgets, slots: int, out_dir: str, threads: int = 0):
        import torch
        import transformers

        from posttrain.checkpoints.export import export_hf

        if threads:
            torch.set_num_threads(threads)
        export_hf(cfg, state, out_dir)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        self.calls = [(torch.tensor(prompts[i:i + slots]), budgets[i:i + slots]) for i in range(0, len(prompts), slots)]

    def __call__(self) -> list[np.ndarray]:
        out = []
        for ids, budgets in self.calls:  # equal prompt lengths: no padding, no mask
            n = max(budgets)
            with self.torch.inference_mode():
                seq = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            toks = seq[:, ids.shape[1]:].numpy().astype(np.int32)
            out += [toks[j, :b] for j, b in enumerate(budgets)]
        return out


def peak_pages(engine) -> dict:
    """The engine's pages at the step with the most allocated (see the module doc)."""
    m = engine.metrics
    allocated, used = m["rollout/kv_pages_allocated"], m["rollout/kv_pages_used"]
    return {"allocated": allocated, "used": used, "allocated_minus_used": allocated - used,
            "live_at_peak": engine.live_at_peak, "max_waste_per_live_seq": engine.max_waste_per_seq}


def main(argv=None) -> dict:
    """Runs the benchmark (see the module doc); prints and returns its JSON."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_long_tail_") as tmp:
        return compare(args, tmp)


def compare(args, tmp: str) -> dict:
    """The benchmark of `args` (transformers' HF directory written under `tmp`)."""
    cfg, graphdef, state = random_weights(args.model)
    prompts, budgets = workload(args, cfg.vocab_size)
    longest = args.short * args.long_factor
    padded = -(-args.prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET
    kv_tokens = args.slots * (padded + longest)  # one sampler call's dense cache, per layer
    engines = {K: Engine(graphdef, state, EngineSettings(
        num_slots=args.slots, num_pages=math.ceil(kv_tokens / args.page_size) + 1, page_size=args.page_size,
        max_seq_len=args.prompt_len + longest, prefill_bucket=PROMPT_BUCKET, decode_chunk=K))
        for K in args.decode_chunk}
    engine = engines[args.decode_chunk[0]]
    requests = [Request(prompt=tuple(p), max_new_tokens=b, temperature=0.0) for p, b in zip(prompts, budgets)]

    def run_engine(engine):  # each round starts from an empty prefix cache: no round reuses an earlier one's pages
        engine.clear_cache()
        return [c.tokens for c in engine.generate(requests, jax.random.key(0))]

    names = {K: "engine" if i == 0 else f"engine_chunk{K}" for i, K in enumerate(args.decode_chunk)}
    sides = {"engine": lambda: run_engine(engine),
             "sampler": lambda: run_sampler(graphdef, state, prompts, budgets, args.slots),
             **{names[K]: (lambda e=e: run_engine(e)) for K, e in engines.items() if names[K] != "engine"}}
    if not args.skip_transformers:
        sides["transformers"] = TransformersSide(cfg, state, prompts, budgets, args.slots, tmp,
                                                 args.torch_threads)
    progress(f"built {list(sides)}; {len(requests)} requests, {sum(budgets)} tokens, {args.slots} slots")
    warm, rounds, outs = {}, {k: [] for k in sides}, {}
    for name, fn in sides.items():
        t = time.perf_counter()
        outs[name] = fn()
        warm[name] = time.perf_counter() - t
        progress(f"{name} warm-up {warm[name]:.1f} s")
    for i in range(args.runs):
        for name, fn in sides.items():
            t = time.perf_counter()
            fn()
            rounds[name].append(time.perf_counter() - t)
            progress(f"{name} round {i + 1}: {rounds[name][-1]:.2f} s")
    useful = int(sum(budgets))
    speed = {k: useful / statistics.median(v) for k, v in rounds.items()}
    per_token = kv_pages.pool_bytes(engine.shapes) / (engine.settings.num_pages * args.page_size)
    agree = lambda side: sum(bool(np.array_equal(a, b)) for a, b in zip(outs["engine"], outs[side]))
    out = {"engine_tokens_per_s": speed["engine"], "sampler_tokens_per_s": speed["sampler"],
           "ratio": speed["engine"] / speed["sampler"], "generated_tokens": useful, "agree": agree("sampler"),
           **({"transformers_tokens_per_s": speed["transformers"],
               "ratio_transformers": speed["engine"] / speed["transformers"],
               "agree_transformers": agree("transformers"), "torch_threads": __import__("torch").get_num_threads()}
              if "transformers" in speed else {}),
           "decode_chunk": engine.chunk_steps,
           "engine_by_chunk": {str(e.chunk_steps): {"tokens_per_s": speed[names[K]], "agree": agree(names[K]),
                                                    "slot_occupancy": e.metrics["rollout/slot_occupancy"],
                                                    "warmup_s": warm[names[K]]} for K, e in engines.items()},
           "engine_metrics": engine.metrics, "peak_pages": peak_pages(engine),
           "engine_kv_bytes": kv_pages.pool_bytes(engine.shapes),
           "sampler_kv_bytes": int(kv_tokens * per_token), "warmup_s": warm, "round_s": rounds,
           "settings": {**vars(args), "num_pages": engine.settings.num_pages, "attention_impl": engine.impl},
           "load_avg_1m": os.getloadavg()[0]}
    if args.profile:
        from _profile import profile_call

        out["profile"] = {name: profile_call(sides[name]) for name in ("sampler", *names.values())}
        progress("profiled: busy " + ", ".join(f"{k} {v['busy_frac']}" for k, v in out["profile"].items()))
    print(json.dumps(out))
    return out
