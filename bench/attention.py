"""Packed-row attention, forward + backward, per implementation: the fused kernels beside blockwise attention.

    python bench/attention.py --json                        # 4 rows x 16k tokens, the variants of this backend
    python bench/attention.py --impls blockwise,dense --rows 2 --row-len 2048 --json
    python bench/attention.py --quick --json                # seconds: `QUICK` shapes, one timed step

Workload: `posttrain.model.blockwise_attention.attend` over --rows packed GRPO rows of --row-len tokens: one prompt
of --prompt-len tokens followed by --group completions (segment 1, branch 0 for the prompt, g for completion g:
a completion sees the prompt and itself, causally), --heads query heads over --kv-heads kv heads of --head-dim;
gradients w.r.t. q, k and v of sum(out * ct) for a fixed cotangent. Implementations (`attention_kernels.IMPLS`):
"blockwise" (the peer: plain JAX, block by block, FlashAttention-2 backward), "splash" (TPU) and "pallas_gpu"
(GPU), the fused kernels, each run only on its own platform (elsewhere they are the Pallas interpreter: a
correctness tool), and "dense" (one softmax over the [T, T] scores). Default: blockwise, dense and the platform's
fused kernel; as in bench/moe.py every variant is compiled first and run only when its peak memory fits the backend
(`_helpers.compile_variants`; dense at 16k rows does not).

FLOPs: 3 x (QK^T + PV) = 3 x 4 x H x N per allowed (query, key) pair (forward + a backward of twice it), counted
from the mask. Prints one JSON line with --json: per implementation, seconds per step, tokens/s, TFLOP/s, peak GiB
and ratio_to_blockwise (blockwise's seconds / its seconds: above 1 is faster).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))

from _helpers import compile_variants, free_bytes, gib, parse_quick, time_variants  # noqa: E402

QUICK = {"rows": 1, "row_len": 256, "prompt_len": 64, "group": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
         "steps": 1}  # --quick, unless given
FUSED = {"tpu": "splash", "gpu": "pallas_gpu"}  # the fused kernel of each platform


def parse_args(argv=None) -> argparse.Namespace:
    """Command line. Raises SystemExit when the completions do not split the row evenly."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row-len", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--group", type=int, default=8, help="completions per row")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 elsewhere)|float32|bfloat16")
    ap.add_argument("--impls", default="", help="comma list of attention_kernels.IMPLS (default: see the doc)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=0.0, help="memory a variant may use (0: the backend's free)")
    ap.add_argument("--json", action="store_true")
    args = parse_quick(ap, argv, QUICK)
    if (args.row_len - args.prompt_len) % args.group or args.row_len <= args.prompt_len:
        ap.error(f"--row-len {args.row_len} - --prompt-len {args.prompt_len} must be a positive multiple of "
                 f"--group {args.group}")
    return args


def row_ids(args):
    """(segment [T], branch [T]) int32 NumPy ids of one packed row: the prompt (branch 0), then the completions."""
    import numpy as np

    completion = (args.row_len - args.prompt_len) // args.group
    branch = np.concatenate([np.zeros(args.prompt_len, np.int32), np.repeat(np.arange(1, args.group + 1), completion)])
    return np.ones(args.row_len, np.int32), branch.astype(np.int32)


def allowed_pairs(args) -> int:
    """(query, key) pairs the mask allows in one row: prompt token i sees i + 1 keys, completion token j (0-based)
    its prompt and j + 1 keys of its own completion."""
    P, C = args.prompt_len, (args.row_len - args.prompt_len) // args.group
    return P * (P + 1) // 2 + args.group * (C * P + C * (C + 1) // 2)


def flops(args) -> float:
    return 3 * 4 * args.head_dim * args.heads * allowed_pairs(args) * args.rows


def attention_loss(impl: str):
    """jit(value_and_grad) of sum(attend(q, k, v) * ct) w.r.t. q, k, v under implementation `impl`."""
    import jax
    import jax.numpy as jnp

    from posttrain.model import blockwise_attention

    def loss(q, k, v, segment, branch, ct):
        out = blockwise_attention.attend(q, {"k": k, "v": v}, blockwise_attention.RowIds(segment, branch), q.shape[-1] ** -0.5, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(args, dtype, sharding=None):
    """q, k, v (normal, `dtype`), segment and branch ids [rows, T], the float32 cotangent; ShapeDtypeStructs with
    `sharding`."""
    import jax
    import jax.numpy as jnp

    B, T, N, K, H = args.rows, args.row_len, args.heads, args.kv_heads, args.head_dim
    shapes = [((B, T, N, H), dtype), ((B, T, K, H), dtype), ((B, T, K, H), dtype), ((B, T), jnp.int32),
              ((B, T), jnp.int32), ((B, T, N, H), jnp.float32)]
    if sharding is not None:
        return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    segment, branch = (jnp.broadcast_to(jnp.asarray(a), (B, T)) for a in row_ids(args))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(kk, s, jnp.float32).astype(d) for kk, (s, d) in zip(keys, [shapes[i] for i in
                                                                                             (0, 1, 2, 5)]))
    return [q, k, v, segment, branch, ct]


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    platform = jax.default_backend()
    dtype = {"auto": jnp.float32 if platform == "cpu" else jnp.bfloat16, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[args.dtype]
    impls = args.impls.split(",") if args.impls else ["blockwise", "dense", *([FUSED[platform]] if platform in FUSED
                                                                             else [])]
    device = jax.devices()[0]
    budget = int(args.max_gib * 2 ** 30) if args.max_gib else free_bytes(device)
    out = {"shape": {k: getattr(args, k) for k in ("rows", "row_len", "prompt_len", "group", "heads", "kv_heads",
                                                    "head_dim")},
           "dtype": jnp.dtype(dtype).name, "platform": platform, "device": device.device_kind,
           "flops_per_step": flops(args), "memory_budget_gib": gib(budget), "quick": args.quick}
    specs = inputs(args, dtype, jax.sharding.SingleDeviceSharding(device))
    out["results"], compiled = compile_variants(attention_loss, impls, specs, budget, "blockwise")
    xs = inputs(args, dtype) if compiled else []
    time_variants(out["results"], compiled, xs, args.steps, "blockwise", args.rows * args.row_len, flops(args))
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
