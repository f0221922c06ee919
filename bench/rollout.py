"""Rollout (generation) benchmark: posttrain's jitted KV-cache sampler vs transformers `generate` on SmolLM2.

    python bench/rollout.py --json [--prompts 64] [--new-tokens 24] [--runs 3] [--model PRESET|PATH]
    python bench/rollout.py --quick        # seconds: `QUICK` (a tiny random model, 4 prompts x 4 tokens, no floor)
    python bench/rollout.py --lengths long_tail [--quick]  # the paged engine vs the sampler (_rollout_long_tail.py)
    python bench/rollout.py --multi_turn N [--quick]  # engine per episode vs sampler turn by turn (_rollout_multi_turn.py)
    python bench/rollout.py --aot h200|v5p|cpu [--quick]  # the engine's decode step compiled ahead of time:
                                                          # per-device memory (_rollout_aot.py)

--model PRESET (a `posttrain.model.presets` name): that preset's random weights (seed 0, float32) and the byte
tokenizer, written once as an HF directory (bench/_helpers.py) from which both sides load, so they run the
same weights; a preset whose vocabulary is smaller than the byte tokenizer's gets 320 ids.
--model PATH: a .gguf file or HF directory for both sides. --group G samples each prompt G times (rows p*G + g,
as in training; greedy, so the copies agree); --prompt-len L replaces the chat prompts by L random token ids
each (seed 0, no stop token among them); --ignore-stop generates exactly --new-tokens per row on both sides
(posttrain without stop ids, transformers with min_new_tokens) and counts them all. --dtype bfloat16 loads
the weights and computes in bfloat16 on both sides (default float32); --torch-device puts transformers on a GPU
("auto": cuda when torch sees one), as `scripts/accelerator_check.py` does on an H200.

Workload: the default model (SmolLM2-135M-Instruct, the default GGUF dequantized to float32) answers 64 chat
prompts of the project's default task ("What is a + b? Answer with just the number.", a, b in [10, 99], seed 0,
rendered with the model's chat template), greedy, 24 new tokens, on this machine's CPU. Both sides get the SAME
prompt token ids (posttrain's tokenizer).
  * posttrain: `posttrain.generate.sampler.sample` (one prefill per prompt, `lax.while_loop` decode with a KV cache),
    float32, prompts right-padded to a multiple of 16, all 64 in one call. The tokens common to all prompts
    (the chat template's system turn) are prefilled once (`shared_prefix_len`, as the training loop does);
    --no-shared-prefix prefills every prompt in full. Once no more than 48, then 32 rows are unfinished, decoding
    continues on that many rows (`sample(shrink=(48, 32))`); --no-shrink keeps all 64 to the end.
  * transformers: `model.generate(do_sample=False, max_new_tokens=24)` with its KV cache, float32, all 64 prompts
    in one left-padded batch with an attention mask, torch's default thread count (on the CPU).
Each side counts only generated tokens up to and including the first stop token (EOS / end of turn). One warm-up
call per side (compile for posttrain) is timed separately; then the sides alternate for --runs rounds, so
background load on a shared machine hits both alike, and each side's median round is reported.

Prints ONE JSON object: posttrain_tokens_per_s, transformers_tokens_per_s, ratio (posttrain / transformers), all
from median rounds; plus each side's best round, warm-up seconds (posttrain's first call includes the jit compile;
its compile estimate is the first call minus the median round), tokens counted per side, per-round seconds, how many
of the 64 greedy outputs agree token-for-token, per side the most rows of a timed round whose greedy tokens differ
from its warm-up call's (`outputs_changed_between_runs`: 0 on the CPU; transformers in bfloat16 on an H200 changed
rows between calls), the prompt shape, thread counts and the 1-minute load average at the end. Unless --no-floor,
it also times the posttrain side's weight matmuls alone (`matmul_floor_s`) and reports ratio_ceiling: the ratio
this run would show if posttrain spent no time beyond them. --profile adds `profile.posttrain`: one more call
under jax.profiler, its device-busy share and largest XLA ops (bench/_profile.py). torch's OpenMP threads slow
down badly when another process takes a core (rounds 5-10x slower were seen on the shared 2-core machine): run it
on a quiet machine and check round_s.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

if any(a.startswith("--aot") for a in sys.argv[1:]):  # compile for a target: no accelerator backend probed
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from posttrain.checkpoints import load_pretrained  # noqa: E402
from posttrain.checkpoints.gguf import default_model_path  # noqa: E402
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample, shared_prefix_len, shrink_schedule  # noqa: E402

from _helpers import parse_quick, progress  # noqa: E402

QUICK = {"model": "tiny-dense", "prompts": 4, "new_tokens": 4, "runs": 1, "no_floor": True}  # --quick, unless given


def model_source(name: str, out_dir: str) -> str:
    """The checkpoint both sides load for --model `name`: a preset's random weights written to `out_dir` as an HF
    directory (see the module doc), a given path, or (empty name) the default GGUF."""
    if not name:
        return str(default_model_path())
    from posttrain.model.presets import PRESETS

    if name not in PRESETS:
        return name
    from _helpers import write_preset_model

    write_preset_model(name, out_dir)
    return out_dir


def make_prompts(tokenizer, n: int, seed: int = 0, length: int = 0, vocab_size: int = 0) -> list[list[int]]:
    """Token ids of n chat prompts of the default arithmetic task, or (`length` > 0) of n prompts of `length`
    random ids in [0, vocab_size) other than the tokenizer's stop and pad ids."""
    rng = np.random.default_rng(seed)
    if length:
        allowed = np.setdiff1d(np.arange(vocab_size), [*tokenizer.stop_ids, tokenizer.pad_id])
        return rng.choice(allowed, (n, length)).tolist()
    pairs = rng.integers(10, 100, (n, 2))
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}], tokenize=True)
        for a, b in pairs]


def until_stop(row, stops) -> list[int]:
    """Tokens up to and including the first stop token (all of them when there is none)."""
    out = []
    for t in row:
        out.append(int(t))
        if int(t) in stops:
            break
    return out


class PosttrainSide:
    def __init__(self, prompts, new_tokens, tokenizer_stop_ids, pad_id, pre, shared_prefix=True, shrink=True, group=1):
        self.pre = pre
        tokens, lengths = pad_prompts(prompts, pad_id)
        self.tokens, self.lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        self.params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        self.stops, self.pad = tuple(tokenizer_stop_ids), pad_id
        self.width = tokens.shape[1]
        # the chat template's system turn + "What is " is common to all prompts: prefilled once (as in training)
        self.shared = shared_prefix_len(tokens, lengths) if shared_prefix else 0
        # once enough rows have stopped, decode continues on fewer rows (the training loop's
        # --config.sampling.decode_shrink_steps=2; off by default there)
        self.shrink = shrink_schedule(tokens.shape[0] * group) if shrink else ()
        self.group = group

    def __call__(self) -> list[list[int]]:
        out = sample(self.pre.graphdef, self.pre.state, self.tokens, self.lengths, jax.random.key(0), group_size=self.group,
                     params=self.params, stop_ids=self.stops, pad_id=self.pad, shared_prefix_len=self.shared,
                     shrink=self.shrink)
        tokens, lengths = jax.device_get((out.tokens_NxLg, out.lengths_N))
        return [tokens[i, :lengths[i]].tolist() for i in range(tokens.shape[0])]


class TransformersSide:
    def __init__(self, prompts, new_tokens, stop_ids, pad_id, source: str, group: int = 1, ignore_stop: bool = False,
                 dtype: str = "float32", device: str = "cpu"):
        import pathlib

        import torch
        import transformers

        self.torch = torch
        path = pathlib.Path(source)
        where = {"pretrained_model_name_or_path": str(path)} if path.is_dir() else {
            "pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, dtype)).eval()
        self.model.to(device)
        width = max(map(len, prompts))
        rows = [p for p in prompts for _ in range(group)]  # row p*G + g, as posttrain's sampler
        self.ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in rows], device=device)
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        self.width, self.new_tokens, self.stops, self.pad = width, new_tokens, tuple(stop_ids), pad_id
        self.ignore_stop = ignore_stop

    def __call__(self) -> list[list[int]]:
        with self.torch.inference_mode():
            out = self.model.generate(self.ids, attention_mask=self.mask, do_sample=False,
                                      max_new_tokens=self.new_tokens, eos_token_id=list(self.stops),
                                      min_new_tokens=self.new_tokens if self.ignore_stop else 0,
                                      pad_token_id=self.pad)
        return [until_stop(row, () if self.ignore_stop else self.stops) for row in out[:, self.width:].tolist()]


def decode_widths(lengths, num_rows: int, new_tokens: int, shrink) -> dict[int, int]:
    """{batch width: decode steps run at that width} for the sampler's loop (see `sample`): the step producing
    token t runs while some row is unfinished (length > t); the width drops to the next `shrink` entry once no
    more rows than it are unfinished."""
    active = lambda t: sum(n > t for n in lengths)
    steps, width, t = {}, num_rows, 1
    for nxt in tuple(w for w in shrink if w < num_rows) + (0,):
        while t < new_tokens and active(t) > nxt:
            steps[width] = steps.get(width, 0) + 1
            t += 1
        width = nxt or width
    return steps


def matmul_floor_s(pre, prefill_rows: int, head_rows: int, steps: dict[int, int], runs: int = 3) -> float:
    """Seconds that the model's weight matmuls ALONE take on this CPU for the posttrain side's work: one prefill of
    `prefill_rows` tokens (LM head on `head_rows` of them) plus `steps` decode steps ({rows: count}, LM head on
    every row), each timed as a jitted chain of the 30 layers' q/k/v/o/gate/up/down matmuls in float32 (same
    weights, `lax.scan` over layers as in the model) and the tied LM head, with no attention, norms or sampling.
    An implementation that runs these float32 matmuls through XLA cannot generate the same tokens faster; only
    faster matmuls (another kernel library, lower precision with hardware support) could."""
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(pre.state)[0]}
    get = lambda name: jnp.asarray(next(v for k, v in flat.items() if f"['{name}']" in k))
    L, D = get("q_proj").shape[:2]
    w = {"q": get("q_proj").reshape(L, D, -1), "k": get("k_proj").reshape(L, D, -1),
         "v": get("v_proj").reshape(L, D, -1), "o": get("o_proj").reshape(L, -1, D),
         "g": get("gate_proj"), "u": get("up_proj"), "d": get("down_proj")}
    emb = get("embedding")

    @functools.partial(jax.jit, static_argnums=1)
    def chain(x_MxD, head):
        def layer(x, w):
            q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
            x = jnp.tanh(x + q @ w["o"])
            return jnp.tanh(x + ((x @ w["g"]) * (x @ w["u"])) @ w["d"]), (k, v)
        x, kv = jax.lax.scan(layer, x_MxD, w)
        return (x[:head] @ emb.T).max(-1), kv

    def best(rows, head):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(rows, D)), jnp.float32)
        jax.block_until_ready(chain(x, head))
        return min(timed(lambda: jax.block_until_ready(chain(x, head)))[0] for _ in range(runs))

    return best(prefill_rows, head_rows) + sum(n * best(rows, rows) for rows, n in steps.items())


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a.startswith("--aot") for a in argv):  # the engine's decode step compiled for a target (_rollout_aot.py)
        from _rollout_aot import main as aot_main

        if argv == sys.argv[1:] and "h200" in argv:  # the CUDA compiler plugin lives in .venv-aot when not here
            from grpo_step import _reexec_in_aot_venv

            _reexec_in_aot_venv("h200", __file__)
        return aot_main(argv)
    if any(a.startswith("--multi_turn") for a in argv):  # per-episode turns vs turn by turn (_rollout_multi_turn.py)
        from _rollout_multi_turn import main as multi_turn

        return multi_turn(argv)
    if any(a.startswith("--lengths") for a in argv):  # the engine vs the sampler (bench/_rollout_long_tail.py)
        from _rollout_long_tail import main as long_tail

        return long_tail(argv)
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        return compare(argv, tmp)


def parse_args(argv=None) -> argparse.Namespace:
    """Command line (`QUICK` fills what --quick leaves unset). Raises SystemExit on bad values."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3, help="timed rounds per side after the warm-up")
    ap.add_argument("--group", type=int, default=1, help="samples per prompt (rows p*G + g)")
    ap.add_argument("--prompt-len", type=int, default=0, help="random prompts of this many tokens (0: chat prompts)")
    ap.add_argument("--ignore-stop", action="store_true", help="exactly --new-tokens per row on both sides")
    ap.add_argument("--no-shared-prefix", action="store_true", help="prefill every prompt in full")
    ap.add_argument("--no-shrink", action="store_true", help="decode all rows until the last one stops")
    ap.add_argument("--no-floor", action="store_true", help="skip timing the matmul floor (see matmul_floor_s)")
    ap.add_argument("--skip-transformers", action="store_true", help="posttrain side only (profiling)")
    ap.add_argument("--profile", action="store_true", help="one more posttrain call under jax.profiler: where its "
                                                           "device time goes (bench/_profile.py), in 'profile'")
    ap.add_argument("--model", default="", help="a preset (random weights), a .gguf / HF dir, or empty: the default")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights, compute: both sides")
    ap.add_argument("--torch-device", default="auto", help="transformers' device: auto (cuda when torch has one)|cpu|cuda")
    args = parse_quick(ap, argv, QUICK)
    if min(args.prompts, args.new_tokens, args.runs, args.group) < 1 or args.prompt_len < 0:
        raise SystemExit("--prompts, --new-tokens, --runs and --group must be >= 1, --prompt-len >= 0")
    return args


def torch_device(args) -> str:
    """--torch-device, "auto" resolved: "cuda" when torch sees a GPU, else "cpu"."""
    if args.torch_device != "auto":
        return args.torch_device
    return "cuda" if __import__("torch").cuda.is_available() else "cpu"


def compare(argv, tmp: str) -> dict:
    """Runs the benchmark of command line `argv` (a preset's weights go to `tmp`); prints and returns its JSON."""
    args = parse_args(argv)
    source = model_source(args.model, tmp)
    t = time.perf_counter()
    pre = load_pretrained(source, dtype=args.dtype, param_dtype=args.dtype)
    load_s = time.perf_counter() - t
    tok = pre.tokenizer
    prompts = make_prompts(tok, args.prompts, length=args.prompt_len, vocab_size=pre.config.vocab_size)
    ours = PosttrainSide(prompts, args.new_tokens, () if args.ignore_stop else tok.stop_ids, tok.pad_id, pre,
                         not args.no_shared_prefix, not args.no_shrink, args.group)
    sides = {"posttrain": ours}
    if not args.skip_transformers:
        sides["transformers"] = TransformersSide(prompts, args.new_tokens, tok.stop_ids, tok.pad_id, source,
                                                 args.group, args.ignore_stop, args.dtype, torch_device(args))
    progress(f"loaded ({load_s:.1f} s) and built {list(sides)}")
    warm, outs = {}, {}
    for name, side in sides.items():  # warm-up (posttrain: the jit compile)
        warm[name], outs[name] = timed(side)
        progress(f"{name} warm-up {warm[name]:.1f} s")
    rounds, changed = {name: [] for name in sides}, {name: 0 for name in sides}
    for i in range(args.runs):  # the sides alternate, so background load hits both alike
        for name, side in sides.items():
            s, out = timed(side)
            changed[name] = max(changed[name], sum(a != b for a, b in zip(out, outs[name])))
            rounds[name].append(s)
            progress(f"{name} round {i + 1}: {s:.2f} s")
    result = summary(args, prompts, ours, outs, warm, rounds, load_s)
    result["outputs_changed_between_runs"] = changed
    if args.profile:
        from _profile import profile_call

        result["profile"] = {"posttrain": profile_call(ours)}
        progress(f"posttrain profiled: busy {result['profile']['posttrain']['busy_frac']} of the call")
    if not args.no_floor:  # how fast the posttrain side could be if only its weight matmuls cost time
        steps = decode_widths(list(map(len, outs["posttrain"])), len(outs["posttrain"]), args.new_tokens, ours.shrink)
        floor = matmul_floor_s(pre, len(prompts) * (ours.width - ours.shared), len(prompts), steps)
        result.update(posttrain_matmul_floor_s=round(floor, 3), posttrain_decode_steps_by_width=steps)
        if "transformers" in sides:  # the ratio this run would show if posttrain spent nothing beyond those matmuls
            n = {k: sum(map(len, v)) for k, v in outs.items()}
            result["ratio_ceiling"] = round(statistics.median(rounds["transformers"]) * n["posttrain"]
                                            / n["transformers"] / floor, 2)
    print(json.dumps(result))
    return result


def summary(args, prompts, ours, outs: dict, warm: dict, rounds: dict, load_s: float) -> dict:
    """The printed JSON object (see the module doc) from each side's outputs, warm-up and round seconds."""
    n = {k: sum(map(len, v)) for k, v in outs.items()}
    med = {k: statistics.median(v) for k, v in rounds.items()}
    result = {"posttrain_tokens_per_s": round(n["posttrain"] / med["posttrain"], 1)}
    warm_s = {"posttrain": round(warm["posttrain"], 2),
              "posttrain_compile_estimate": round(warm["posttrain"] - med["posttrain"], 2)}  # first minus steady
    if "transformers" in outs:
        result["transformers_tokens_per_s"] = round(n["transformers"] / med["transformers"], 1)
        result["ratio"] = round(result["posttrain_tokens_per_s"] / result["transformers_tokens_per_s"], 2)
        warm_s["transformers"] = round(warm["transformers"], 2)
        result["best_round_tokens_per_s"] = {k: round(n[k] / min(v), 1) for k, v in rounds.items()}
        result["outputs_agreeing"] = sum(a == b for a, b in zip(outs["posttrain"], outs["transformers"]))
    result.update(
        tokens_counted=n, warmup_s=warm_s, round_s={k: [round(x, 3) for x in v] for k, v in rounds.items()},
        prompts=args.prompts, group=args.group, rows=args.prompts * args.group, new_tokens=args.new_tokens,
        ignore_stop=args.ignore_stop, prompt_tokens_mean=round(float(np.mean(list(map(len, prompts)))), 1),
        posttrain_prompt_width=ours.width, posttrain_shared_prefix_len=ours.shared,
        posttrain_load_s=round(load_s, 2), posttrain_shrink=list(ours.shrink), dtype=args.dtype,
        model=args.model or "SmolLM2-135M-Instruct", quick=args.quick,
        torch_threads=__import__("torch").get_num_threads() if "transformers" in outs else None,
        torch_device=torch_device(args) if "transformers" in outs else None,
        cpu_count=os.cpu_count(), load_avg_1m=round(os.getloadavg()[0], 2))
    return result


if __name__ == "__main__":
    main()
