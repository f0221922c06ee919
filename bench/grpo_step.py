"""GRPO train-step benchmark for any backend: step time, tokens/s, MFU and per-device peak memory; or, with
--aot, the same step compiled ahead of time for an H200 / TPU v5p on this machine (no accelerator needed).

MFU = model FLOPs (`posttrain.model.flops`: 6 x active non-embedding params x tokens + LM head over scored tokens +
causal attention of the packed rows) / step seconds / peak, against the bf16 (or compute-dtype) matmul peak
measured in the same process, and against the chip's published peak where known. `mfu_6nd` is the older figure,
6 x all params x tokens, for comparison with earlier runs.

  python bench/grpo_step.py --json                                   # SmolLM2-135M at the quickstart's shapes
  python bench/grpo_step.py --model qwen3-0.6b --dtype bfloat16 --param-dtype float32 \\
      --rows 16 --row-len 2176 --remat full --json                   # random weights of a preset
  python bench/grpo_step.py ... --aot h200 --json                    # peak_gib from memory_analysis(), no GPU
  python bench/grpo_step.py --quick --json                           # seconds: `QUICK` (tiny-dense, 2 x 48)

Packed rows: each row is one prompt of --prompt-len tokens followed by --group-size completions, so
--row-len = prompt_len + group_size x completion_len. Prints one JSON line with --json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers import parse_quick  # noqa: E402

PUBLISHED_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12}
# --quick, unless given: a tiny preset on 2 packed rows, one timed step, the matmul peak at 256^3
QUICK = {"model": "tiny-dense", "rows": 2, "row_len": 48, "group_size": 1, "prompt_len": 16, "steps": 1}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a preset name (random weights), a .gguf / HF dir, or empty for "
                                                "the default SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--dtype", default="auto", help="compute dtype: auto|float32|bfloat16 (auto: f32 on CPU)")
    ap.add_argument("--param-dtype", default="auto", help="master-weight dtype: auto|float32|bfloat16")
    ap.add_argument("--matmul-precision", default="default", choices=("default", "high", "highest"))
    ap.add_argument("--rows", type=int, default=0, help="packed rows (0: the quickstart's 8 x 8 x 24 layout)")
    ap.add_argument("--row-len", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--remat", default="dots", choices=("none", "dots", "names", "full"))
    ap.add_argument("--remat-names", default="attn_out,mlp_in", help="for --remat names")
    ap.add_argument("--attention", default="auto", help="ModelConfig.attention_impl of packed rows: auto|blockwise|"
                                                        "splash|pallas_gpu|dense")
    ap.add_argument("--lora_rank", type=int, default=0)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--aot", default="", choices=("", "h200", "v5p"), help="compile for this chip; do not run")
    ap.add_argument("--profile", action="store_true", help="one more step under jax.profiler: its device-busy "
                                                           "share and largest XLA ops (bench/_profile.py)")
    ap.add_argument("--json", action="store_true")
    args = parse_quick(ap, argv, QUICK)
    if bool(args.rows) != bool(args.row_len):
        ap.error("--rows and --row-len go together")
    if args.rows and (args.row_len - args.prompt_len) % args.group_size:
        ap.error(f"--row-len {args.row_len} - --prompt-len {args.prompt_len} must be a multiple of --group-size "
                 f"{args.group_size}")
    return args


def matmul_peak(dtype, n: int, reps: int = 10) -> float:
    """FLOP/s of a jitted n^3 matmul (float32 accumulation) in `dtype`, best of 3 rounds."""
    import jax
    import jax.numpy as jnp

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
    import numpy as np

    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.rollout import batching
    from posttrain.rollout.episodes import Sample, chat_prompt

    rng = np.random.default_rng(seed)
    samples = []
    for p in range(P):
        a, b = rng.integers(10, 100, 2)
        prompt = chat_prompt(tokenizer, f"What is {a} + {b}? Answer with just the number.")
        for _ in range(G):
            toks = rng.integers(100, 40000, completion_len).astype(np.int32)
            samples.append(Sample(domain="arithmetic", group=p, prompt_ids=prompt,
                                  segments=[(toks, -rng.random(completion_len).astype(np.float32), True)],
                                  reward=float(rng.random() < 0.3), status="ok", done=True))
    return batching.assemble(samples, advantage_fn("grpo"), group_size=G, pad_id=tokenizer.pad_id)[0]


def model_config(args, backend: str):
    """(ModelConfig, loaded Pretrained or None) for --model under the precision policy of `backend`."""
    from posttrain.model.config import LoRAConfig
    from posttrain.model.presets import PRESETS, get_preset
    from posttrain.infra.precision import resolve_policy

    policy = resolve_policy(args.dtype, args.param_dtype, args.matmul_precision, backend=backend)
    fields = dict(dtype=policy.compute_dtype, param_dtype=policy.param_dtype, matmul_precision=policy.matmul_precision,
                  attention_impl=args.attention, remat=args.remat,
                  remat_names=tuple(n for n in args.remat_names.split(",") if n),
                  lora=LoRAConfig(rank=args.lora_rank) if args.lora_rank else None)
    if args.model in PRESETS:
        return get_preset(args.model, **fields), None
    if args.aot:
        sys.exit(f"error: --aot needs a preset (--model one of {sorted(PRESETS)}), got {args.model!r}")
    from posttrain.checkpoints import load_pretrained

    pre = load_pretrained(args.model or None, **fields)
    return pre.config, pre


def make_batch(args, cfg, pretrained):
    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.rollout.batching import random_batch

    if args.rows:
        batch = random_batch(0, advantage_fn("grpo"), prompts=args.rows, group_size=args.group_size, prompt_len=args.prompt_len,
                             completion_len=(args.row_len - args.prompt_len) // args.group_size,
                             vocab_size=cfg.vocab_size)
        if batch.tokens_RxL.shape != (args.rows, args.row_len):
            sys.exit(f"error: packed rows came out {batch.tokens_RxL.shape}, not ({args.rows}, {args.row_len}): use a "
                     "--prompt-len that is a multiple of 16 and a completion region that is a multiple of 32")
        return batch
    if pretrained is not None and pretrained.tokenizer is not None:
        return quickstart_batch(pretrained.tokenizer)
    return random_batch(0, advantage_fn("grpo"), prompts=8, group_size=8, prompt_len=32, completion_len=24, vocab_size=cfg.vocab_size)


def has_cuda_compiler_plugin() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def _reexec_in_aot_venv(target: str, script: str = __file__) -> None:
    """Runs `script` (this one by default) with this command's arguments under .venv-aot (made by
    `VENV=.venv-aot scripts/setup_env.sh aot`) when the current interpreter lacks the CUDA compiler plugin that
    --aot h200 needs and that venv has it."""
    import os

    if target != "h200" or has_cuda_compiler_plugin():
        return
    venv = pathlib.Path(__file__).resolve().parents[1] / ".venv-aot"
    python = venv / "bin" / "python"
    if python.exists() and pathlib.Path(sys.prefix).resolve() != venv.resolve():
        os.execv(str(python), [str(python), str(pathlib.Path(script).resolve()), *sys.argv[1:]])


def main(argv=None):
    args = parse_args(argv)
    if args.aot:
        import os

        if argv is None:
            _reexec_in_aot_venv(args.aot)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from posttrain.algos.grpo import losses
    from posttrain.algos.grpo import step as step_lib
    from posttrain.learn import optim
    from posttrain.model import flops as flops_lib

    backend = {"h200": "gpu", "v5p": "tpu"}.get(args.aot, jax.default_backend())
    cfg, pre = model_config(args, backend)
    batch = make_batch(args, cfg, pre)
    opts = step_lib.StepOptions(loss=losses.LossConfig(), temperature=1.0, lora_rank=args.lora_rank,
                          num_microbatches=args.microbatches, matmul_precision=cfg.matmul_precision)
    opt = optim.make_optimizer("adamw", lr=1e-5 if not args.lora_rank else 1e-4, schedule="constant")
    abstract_model = flops_lib.abstract_model_state(cfg)
    fl = flops_lib.train_step_flops(cfg, abstract_model, batch, lora=bool(args.lora_rank))
    out = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
           "matmul_precision": cfg.matmul_precision, "remat": cfg.remat, "lora_rank": args.lora_rank,
           "microbatches": args.microbatches, "params": fl.total_params, "active_params": fl.active_params,
           "rows": int(batch.tokens_RxL.shape[0]), "row_len": int(batch.tokens_RxL.shape[1]),
           "tokens_per_step": fl.tokens, "scored_tokens": fl.scored_tokens, "model_flops_per_step": fl.total}
    if args.aot:
        try:
            out.update(aot_compile(args, cfg, opts, opt, batch, fl))
        except RuntimeError as e:
            sys.exit(f"error: {e}")
    else:
        out.update(run_steps(args, cfg, pre, opts, opt, batch, fl))
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


def run_steps(args, cfg, pre, opts, opt, batch, fl) -> dict:
    """Runs the jitted, donated train step once (compile) and `args.steps` timed times on this machine's first
    device; returns the timing, MFU and memory figures (median step seconds over the timed steps)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posttrain.algos.grpo import step as step_lib
    from posttrain.learn.state import create_train_state

    if pre is not None:
        graphdef, model_state = pre.graphdef, pre.state
    else:
        from posttrain.model.transformer import Transformer

        graphdef, model_state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = create_train_state(graphdef, model_state, opt.tx, jax.random.key(0), lora_rank=opts.lora_rank)
    step = jax.jit(step_lib.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts), donate_argnums=(0,))
    jbatch = jax.tree.map(jnp.asarray, batch)
    t = time.perf_counter()
    state, m = step(state, jbatch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, m = step(state, jbatch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    profile = None
    if args.profile:
        from _profile import profile_call

        holder = [state]

        def one_step():
            holder[0], metrics = step(holder[0], jbatch)
            return metrics

        profile = profile_call(one_step)
    device = jax.devices()[0]
    peak = matmul_peak(jnp.dtype(cfg.dtype), 256 if args.quick else 2048 if device.platform == "cpu" else 8192)
    published = next((v for k, v in PUBLISHED_PEAK_BF16.items() if k in device.device_kind), None)
    stats = device.memory_stats() or {}
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return {"device": device.device_kind, "step_s": step_s, "steps_s": times, "first_call_s": first,
            "tokens_per_s": fl.tokens / step_s, "model_flops_per_s": fl.total / step_s,
            "peak_flops_per_s": peak, "mfu": fl.total / step_s / peak,
            "mfu_published_peak": fl.total / step_s / published if published else None,
            "mfu_6nd": 6 * fl.total_params * fl.tokens / step_s / peak,
            "peak_gib": stats["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in stats else rss_gib,
            "peak_rss_gib": rss_gib, "loss": float(m["policy/loss"]),
            "finite": bool(np.isfinite(float(m["optim/grad_norm"]))), **({"profile": profile} if profile else {})}


def aot_compile(args, cfg, opts, opt, batch, fl) -> dict:
    """Lowers and compiles the donated, sharded train step for one device of `args.aot`; no weights allocated."""
    from posttrain.algos.grpo import step as step_lib
    from posttrain.infra import aot
    from posttrain.infra import mesh as mesh_lib
    from posttrain.recipes import plan

    devices = aot.target_devices(args.aot)
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1, "expert": 1}, devices=devices[:1])
    graphdef, state, state_sh = plan.abstract_train_state(cfg, opt.tx, mesh, lora_rank=opts.lora_rank,
                                                          need_reference=opts.loss.beta > 0)
    batch_abs, batch_sh = plan.abstract_batch(batch, mesh)
    step_fn = step_lib.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts)
    report, seconds, _, _ = plan.compile_train_step(step_fn, state, state_sh, batch_abs, batch_sh, mesh)
    target = aot.TARGETS[args.aot]
    return {"aot": args.aot, "device": str(devices[0].device_kind), "compile_s": round(seconds, 1),
            **report.as_dict(), "hbm_gib": round(target.hbm_bytes / aot.GIB, 1),
            "fits": aot.fits(report.peak, target.hbm_bytes),
            "step_s_at_published_peak": fl.total / target.peak_bf16_flops}


if __name__ == "__main__":
    main()
