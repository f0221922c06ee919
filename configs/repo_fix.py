"""Multi-turn GRPO on RepoFix-v0 (issue 27): SmolLM2-135M repairs small Python repositories through tool calls
(read_file, write_file, apply_patch, run, list_files, submit); reward 1 when every hidden test passes (tamper-proof
scoring in a fresh sandbox), tool results masked out of the loss.

SmolLM2's ChatML template has no tool syntax, so the env shows the tool schema in its first observation and reads
``<tool_call>{json}</tool_call>`` from the reply text; a template that renders ``tools`` (Qwen2.5 / Qwen3) gets the
schema through its own ``tools=`` argument instead (`posttrain.rollout.chat`).
Evaluate: posttrain eval --suite=configs/eval/agentic.py --checkpoint=runs/repo_fix --baseline=base
(resolved rate `eval/repo_fix/pass@1`, cheat rate `eval/repo_fix_impossible/pass@1`).

A few steps on the 2-core CPU (issue 27 acceptance 4): the shipped step (16 samples, 16 unpacked rows of up to
~3k tokens) is estimated, not measured quietly, at ~10 minutes on 2 quiet cores (~55 TFLOP at ~120 GFLOP/s, plus
sampling); 2 x 2 samples of 128 tokens a turn (one such step took 1012 s on the loaded machine, f5d4449) and 4
tasks per suite domain aim at ~20 minutes for 4 steps and both evaluations:
  posttrain train --config=configs/repo_fix.py --workdir=runs/repo_fix4 --noprogress --config.train.steps=4
      --config.rl.prompts_per_step=2 --config.rl.group_size=2 --config.rl.num_microbatches=4
      --config.sampling.max_new_tokens=128
  posttrain eval --suite=configs/eval/agentic.py --checkpoint=runs/repo_fix4 --baseline=base --limit=4
"""
from posttrain.config import default_config, env_spec

MAX_TURNS = 4


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.max_turns = MAX_TURNS
    c.env.train = {"repo_fix": env_spec("posttrain/RepoFix-v0", split="train", max_turns=MAX_TURNS,
                                        max_output_chars=1500)}  # the env's turn limit too: scored when it ends
    c.env.eval = {}  # evaluation: configs/eval/agentic.py through posttrain eval
    c.env.num_workers = 2
    c.rl.packed = False
    c.rl.prompts_per_step = 4
    c.rl.group_size = 4
    c.sampling.max_new_tokens = 192
    c.sampling.prompt_bucket = 1024  # contexts grow by ~1k tokens a turn: one sampler program per 1k, not per 16
    # 16 unpacked rows: the prompt (~800 tokens) and three tool results of up to 1500 characters come on top of
    # 4 x 192 sampled tokens, so the check compiles for 2048 prompt tokens; remat of matmul outputs only and one
    # row per accumulation microbatch (the same gradient) keep the step's compiled peak inside the 24 GB machine
    c.train.preflight_prompt_len = 2048
    c.model.remat = "dots"
    c.rl.num_microbatches = 16
    c.optim.lr = 1e-6
    c.train.steps = 50
    c.train.workdir = "runs/repo_fix"
    return c
