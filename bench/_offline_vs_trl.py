"""The machinery of bench/sft_vs_trl.py and bench/dpo_vs_trl.py (not a benchmark): one offline setting, two
trainers (posttrain's `recipes.sft` / `recipes.dpo` and TRL's `SFTTrainer` / `DPOTrainer`), each side in its own
child process (its own peak RSS), one after the other, on the same data, rows per step and sequence length.

Data: arithmetic conversations ("What is a + b?" -> "a + b = c.", a, b from a seeded NumPy stream), as TRL's
conversational prompt-completion records (SFT) or preference records (DPO: the rejected reply says c + 1), which
both sides render with the model's own chat template; the loss on the completion only on both sides. Setting
(both sides): float32, full fine-tuning, no packing, AdamW (b1 0.9, b2 0.999, eps 1e-8, weight decay 0), the
constant learning rate `lr`, no warm-up, grad-norm clip 1.0, one optimizer step per batch, no gradient
accumulation, no activation checkpointing (posttrain remat "none", TRL gradient_checkpointing False), no
evaluation and no checkpoint inside the timed steps. Step time: posttrain's `perf/step_s` (batch assembly +
jitted update, metrics.jsonl); TRL's `on_step_begin` -> `on_step_end` (collation + forward/backward + AdamW).
Step 1 is the warm-up (XLA compile; torch's first call) and is left out of the median. Peak memory: each child's
`ru_maxrss` (model loading included). Tokens per step: the non-padding tokens each side trains on (posttrain
`perf/tokens_per_s` x step time; TRL's logged `num_tokens` difference).
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

import numpy as np

QUICK_PRESET = ("tiny-dense", {"vocab_size": 320})


def settings(kind: str, quick: bool, steps: int) -> dict:
    """The run's settings (`kind`: "sft" | "dpo"); JSON-able, stated in the output."""
    rows = 2 if quick else 8
    return {"kind": kind, "quick": quick, "steps": steps, "warmup_steps": 1, "rows_per_step": rows,
            "seq_len": 64 if quick else 128, "max_prompt_len": 32 if quick else 64,
            "max_completion_len": 16 if quick else 32, "lr": 1e-5, "lr_schedule": "constant", "beta": 0.1,
            "loss": "sigmoid", "dtype": "float32", "packing": False, "seed": 0,
            "model": f"{QUICK_PRESET[0]} (random, byte tokenizer)" if quick else "SmolLM2-135M-Instruct Q4_1 GGUF "
                     "dequantised to float32", "trl": {"use_cpu": True, "bf16": False, "fp16": False,
                                                       "gradient_checkpointing": False, "optim": "adamw_torch",
                                                       "dataloader_num_workers": 0, "precompute_ref_log_probs":
                                                       kind == "dpo", "completion_only_loss": kind == "sft"},
            "posttrain": {"remat": "none", "reference_cache": kind == "dpo", "packing": False}}


def records(kind: str, n: int, seed: int = 0) -> list[dict]:
    """n conversational records (module doc): prompt/completion for "sft", prompt/chosen/rejected for "dpo"."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(10, 100, 2))
        user = [{"role": "user", "content": f"What is {a} + {b}?"}]
        reply = lambda c: [{"role": "assistant", "content": f"{a} + {b} = {c}."}]
        out.append({"prompt": user, "completion": reply(a + b)} if kind == "sft" else
                   {"id": f"p{i}", "prompt": user, "chosen": reply(a + b), "rejected": reply(a + b + 1)})
    return out


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


# ------------------------------------------------------------------------------------------------ posttrain side
def run_posttrain(s: dict) -> dict:
    """s["steps"] steps of posttrain's SFT (s["kind"] "sft", or "sft_pairs": both replies of the DPO pairs as
    2 x rows conversations) or DPO (cached reference) on s["records"]; step times and tokens from metrics.jsonl."""
    from posttrain.config.dpo import default_dpo_config, dpo_config_from_dict
    from posttrain.config.sft import default_sft_config, sft_config_from_dict
    from posttrain.recipes import dpo, sft

    kind = s["kind"]
    with tempfile.TemporaryDirectory(prefix="offline_vs_trl_pt_") as workdir:
        c = default_dpo_config() if kind == "dpo" else default_sft_config()
        c.model.path, c.model.remat = s["model_path"], s["posttrain"]["remat"]
        c.optim.lr, c.optim.schedule = s["lr"], s["lr_schedule"]
        c.checkpoint.every_steps, c.checkpoint.async_save = 10 * s["steps"] + 1000, False
        c.train.steps, c.train.seed, c.train.workdir = s["steps"], s["seed"], workdir
        if kind == "dpo":
            d = c.dpo
            d.train_examples, d.pairs_per_step, d.beta = tuple(s["records"]), s["rows_per_step"], s["beta"]
            d.max_prompt_len, d.max_completion_len = s["max_prompt_len"], s["max_completion_len"]
            d.eval_at_start = d.eval_at_end = False
            summary = dpo.train(dpo.make_dpo_plan(dpo_config_from_dict(c)), progress=False)
        else:
            data = s["records"] if kind == "sft" else [
                {"prompt": r["prompt"], "completion": r[k]} for r in s["records"] for k in ("chosen", "rejected")]
            rows = s["rows_per_step"] * (1 if kind == "sft" else 2)
            c.sft.train_examples, c.sft.rows_per_step, c.sft.seq_len = tuple(data), rows, s["seq_len"]
            c.sft.packing, c.sft.eval_at_start, c.sft.eval_at_end = False, False, False
            summary = sft.train(sft.make_sft_plan(sft_config_from_dict(c)), progress=False)
        rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
        rows = [r for r in rows if "perf/step_s" in r]
    return {"steps_s": [r["perf/step_s"] for r in rows],
            "tokens_per_step": [round(r["perf/tokens_per_s"] * r["perf/step_s"]) for r in rows],
            "losses": [r.get("sft/loss", r.get("dpo/loss")) for r in rows], "peak_rss_gb": peak_rss_gb(),
            "summary_end_step": summary.get("end_step")}


# ------------------------------------------------------------------------------------------------------ TRL side
def load_hf_model(model_path: str):
    """(float32 transformers model, tokenizer) of an HF directory or a GGUF file (its quantizer record dropped:
    the weights are plain float32 tensors; as bench/grpo_vs_trl.py)."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(model_path)
    where = {"pretrained_model_name_or_path": path} if path.is_dir() else {
        "pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(**where)
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def run_trl(s: dict) -> dict:
    """s["steps"] steps of TRL's SFTTrainer or DPOTrainer (s["kind"]) on s["records"]; step times from a callback."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                tokens.append(float(logs["num_tokens"]))

    model, tok = load_hf_model(s["model_path"])
    common = dict(output_dir=tempfile.mkdtemp(prefix="offline_vs_trl_trl_"), use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, per_device_train_batch_size=s["rows_per_step"],
                  gradient_accumulation_steps=1, learning_rate=s["lr"], lr_scheduler_type=s["lr_schedule"],
                  warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                  max_grad_norm=1.0, optim="adamw_torch", max_steps=s["steps"], logging_steps=1, report_to="none",
                  save_strategy="no", eval_strategy="no", seed=s["seed"], dataloader_num_workers=0)
    data = Dataset.from_list(s["records"])
    if s["kind"] == "sft":
        args = trl.SFTConfig(**common, max_length=s["seq_len"], packing=False, completion_only_loss=True)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                 callbacks=[Timer()])
    else:
        args = trl.DPOConfig(**common, beta=s["beta"], loss_type=[s["loss"]], precompute_ref_log_probs=True,
                             max_length=s["max_prompt_len"] + s["max_completion_len"])
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                 callbacks=[Timer()])
    trainer.train()
    per_step = np.diff([0.0] + tokens).tolist() if tokens else []
    return {"steps_s": times, "tokens_per_step": per_step, "peak_rss_gb": peak_rss_gb(),
            "trl_version": trl.__version__, "torch_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------------------- driver
def run_side(script: str, side: str, spec: dict, timeout: float) -> dict:
    """Runs `side` of `script` in a child process (its output to our stderr); returns its result dict. Raises
    RuntimeError naming the side and exit code when the child fails."""
    with tempfile.TemporaryDirectory(prefix="offline_vs_trl_") as d:
        spec_path = os.path.join(d, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        proc = subprocess.run([sys.executable, script, "--side", side, "--spec", spec_path], stdout=sys.stderr,
                              stderr=sys.stderr, timeout=timeout, cwd=root, env=env)
        if proc.returncode != 0 or not os.path.exists(spec_path + ".out"):
            raise RuntimeError(f"{side} side failed (exit code {proc.returncode}); its log is on stderr above")
        with open(spec_path + ".out") as f:
            return json.load(f)


def child(side: str, spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    res = (run_trl if side == "trl" else run_posttrain)(spec)
    with open(spec_path + ".out", "w") as f:
        json.dump(res, f)


def timed(res: dict, s: dict) -> float:
    """Median step seconds after the warm-up. Raises ValueError when the side ran another number of steps."""
    if len(res["steps_s"]) != s["steps"]:
        raise ValueError(f"expected {s['steps']} step times, got {res['steps_s']}")
    return statistics.median(res["steps_s"][s["warmup_steps"]:])


def compare(script: str, kind: str, quick: bool, steps: int, timeout: float) -> dict:
    """Both sides (and for DPO posttrain's SFT step on the same pairs) -> the printed JSON object."""
    s = settings(kind, quick, steps)
    with tempfile.TemporaryDirectory(prefix="offline_vs_trl_model_") as model_dir:
        if quick:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _helpers import write_preset_model

            model_path = os.path.join(model_dir, "model")
            write_preset_model(QUICK_PRESET[0], model_path, QUICK_PRESET[1])
        else:
            from posttrain.checkpoints.gguf import default_model_path

            model_path = str(default_model_path())
        spec = dict(s, model_path=model_path, records=records(kind, s["rows_per_step"] * s["steps"], s["seed"]))
        pt = run_side(script, "posttrain", spec, timeout)
        sft_pairs = run_side(script, "posttrain", dict(spec, kind="sft_pairs"), timeout) if kind == "dpo" else None
        tr = run_side(script, "trl", spec, timeout)
    a, b = timed(pt, s), timed(tr, s)
    out = {"posttrain_step_s": a, "trl_step_s": b, "ratio": a / b,
           "posttrain_peak_rss_gb": pt["peak_rss_gb"], "trl_peak_rss_gb": tr["peak_rss_gb"],
           "peak_memory_ratio": pt["peak_rss_gb"] / tr["peak_rss_gb"],
           "tokens_per_step": {"posttrain": pt["tokens_per_step"][1:], "trl": tr["tokens_per_step"][1:]},
           "posttrain_steps_s": pt["steps_s"], "trl_steps_s": tr["steps_s"], "posttrain_losses": pt["losses"],
           "trl_version": tr["trl_version"], "trl_torch_threads": tr["torch_threads"], "cpus": os.cpu_count(),
           "load_avg_1min": os.getloadavg()[0], "settings": s}
    if sft_pairs is not None:
        c = timed(sft_pairs, s)
        out.update({"sft_step_s_same_pairs": c, "dpo_over_sft_step": a / c,
                    "sft_same_pairs_tokens_per_step": sft_pairs["tokens_per_step"][1:]})
    return out


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """The command line both benchmarks share. Raises SystemExit (argparse) on bad values, e.g. --steps < 2."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", action="store_true", help="one line of JSON (else indented)")
    ap.add_argument("--quick", action="store_true", help="seconds: a tiny random preset, 2 rows x 2 steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per side, the first one a warm-up (default 4; "
                    "--quick 2)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per side")
    ap.add_argument("--side", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 4)
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (one warm-up, one timed), got {a.steps}")
    return a


def main(script: str, kind: str, description: str, argv=None) -> None:
    """A benchmark script's entry point: the parent compares both sides (each in a child process of `script`),
    a child (--side) runs one; prints one JSON object."""
    a = parse_args(description, argv)
    if a.side:
        return child(a.side, a.spec)
    out = compare(os.path.abspath(script), kind, a.quick, a.steps, a.timeout)
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
