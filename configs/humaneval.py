"""GRPO on HumanEval (Chen et al. 2021): completions run against the problem's unit tests in the sandbox.

HumanEval has one split of 164 problems; training and evaluating on it measures fitting, not generalisation.
Use it to exercise the code-execution reward path; swap in your own train set for real runs.
"""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.env.train = {"humaneval": env_spec("posttrain/HumanEval-v0")}
    c.env.eval = {"humaneval": env_spec("posttrain/HumanEval-v0")}
    c.env.num_workers = 2
    c.sampling.max_new_tokens = 384
    c.eval.max_new_tokens = 384
    c.eval.num_tasks = 164
    c.optim.lr = 1e-6
    c.train.steps = 100
    c.train.workdir = "runs/humaneval"
    return c
