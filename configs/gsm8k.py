"""GRPO on GSM8K (grade-school math; Cobbe et al. 2021) with the default SmolLM2 policy.

Data: `--config.env.train.gsm8k.kwargs.path=/path/to/train.jsonl` (the `{"question","answer"}` JSONL format),
or leave the path empty to load through TFDS (`tfds.load("gsm8k")`, needs TensorFlow and network once).
"""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.env.train = {"gsm8k": env_spec("posttrain/GSM8K-v0", split="train", path="")}
    c.env.eval = {"gsm8k": env_spec("posttrain/GSM8K-v0", split="test", path="")}
    c.sampling.max_new_tokens = 256
    c.eval.max_new_tokens = 256
    c.eval.num_tasks = 100
    c.rl.loss = "ppo"
    c.rl.eps_high = 0.28
    c.optim.lr = 1e-6
    c.train.steps = 200
    c.train.workdir = "runs/gsm8k"
    return c
