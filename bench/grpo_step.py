"""Train-step throughput and MFU of the GRPO update on SmolLM2-135M (the quickstart's shapes).

MFU = 6 * params * tokens / step_seconds / peak, with `peak` measured in the same run by a jitted 2048^3 matmul
in the same dtype, and `tokens` the non-padding tokens the step processes (prompt once per group + every
completion token; packed rows). Prints one JSON object with --json.

  python bench/grpo_step.py --json [--dtype float32] [--lora_rank 0] [--completion_len 24] [--steps 3] [--remat dots]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_peak(dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a jitted n^3 matmul (float32 accumulation) in `dtype`."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            r = f(a, a)
        r.block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return 2 * n ** 3 / min(times)


def quickstart_batch(tokenizer, P=8, G=8, completion_len=24, seed=0):
    """A packed batch shaped like a quickstart step: P arithmetic prompts x G completions of `completion_len`."""
    from posttrain import batching
    from posttrain.rollout import Sample, chat_prompt

    rng = np.random.default_rng(seed)
    samples = []
    for p in range(P):
        a, b = rng.integers(10, 100, 2)
        prompt = chat_prompt(tokenizer, f"What is {a} + {b}? Answer with just the number.")
        for g in range(G):
            toks = rng.integers(100, 40000, completion_len).astype(np.int32)
            samples.append(Sample(domain="arithmetic", group=p, prompt_ids=prompt,
                                  segments=[(toks, -rng.random(completion_len).astype(np.float32), True)],
                                  reward=float(rng.random() < 0.3), status="ok", done=True))
    return batching.assemble(samples, group_size=G, pad_id=tokenizer.pad_id)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lora_rank", type=int, default=0)
    ap.add_argument("--completion_len", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--remat", default="dots", choices=("none", "dots", "full"), help="layer remat (quickstart: dots)")
    ap.add_argument("--microbatches", type=int, default=1)
    args = ap.parse_args()

    from posttrain import losses, optim
    from posttrain import train_step as ts
    from posttrain.checkpoints import load_pretrained
    from posttrain.model.config import LoRAConfig

    lora = LoRAConfig(rank=args.lora_rank) if args.lora_rank else None
    pre = load_pretrained(dtype=args.dtype, remat=args.remat, lora=lora)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(pre.state))
    batch = jax.tree.map(jnp.asarray, quickstart_batch(pre.tokenizer, completion_len=args.completion_len))
    tokens = int(np.asarray(batch.segment_ids_RxL != 0).sum())
    opts = ts.StepOptions(loss=losses.LossConfig(), temperature=1.0, lora_rank=args.lora_rank,
                          num_microbatches=args.microbatches)
    opt = optim.make_optimizer("adamw", lr=1e-5 if not lora else 1e-4, schedule="constant")
    graphdef, state = ts.create_train_state(pre.graphdef, pre.state, opt.tx, jax.random.key(0), opts)
    step = jax.jit(ts.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts), donate_argnums=(0,))
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    peak = matmul_peak(jnp.dtype(args.dtype))
    flops = 6 * n_params * tokens
    out = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "lora_rank": args.lora_rank, "remat": args.remat,
           "microbatches": args.microbatches,
           "params": n_params, "tokens_per_step": tokens, "rows": int(batch.tokens_RxL.shape[0]),
           "row_width": int(batch.tokens_RxL.shape[1]), "step_s": step_s, "steps_s": times,
           "first_call_s": compile_s, "tokens_per_s": tokens / step_s, "model_flops_per_s": flops / step_s,
           "peak_flops_per_s": peak, "mfu": flops / step_s / peak,
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
