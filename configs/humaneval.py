"""GRPO on HumanEval (Chen et al. 2021): completions run against the problem's unit tests in the sandbox.

HumanEval has one split of 164 problems; training and evaluating on it measures fitting, not generalisation.
Use it to exercise the code-execution reward path; swap in your own train set for real runs.
"""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.train = {"humaneval": env_spec("posttrain/HumanEval-v0")}
    c.env.eval = {"humaneval": env_spec("posttrain/HumanEval-v0")}
    c.env.num_workers = 2
    c.sampling.max_new_tokens = 384
    c.eval.max_new_tokens = 384
    c.eval.num_tasks = 32               # all 164 took 300 s at the start of the run on 2 cores
    # 8 packed rows of up to 8 x 384 completion tokens: with no remat the step's compiled peak is 27.9 GiB; saving
    # matmul outputs only and 4 accumulation microbatches (same gradient) bring it to 6.8 GiB at 384 prompt tokens
    # (HumanEval's prompts are up to ~400 tokens; `posttrain.runs.preflight` checks it before the model loads)
    c.model.remat = "dots"
    c.rl.num_microbatches = 4
    c.train.preflight_prompt_len = 384
    c.optim.lr = 1e-6
    c.train.steps = 100
    c.train.workdir = "runs/humaneval"
    return c
