"""GRPO on GSM8K (grade-school math; Cobbe et al. 2021) with the default SmolLM2 policy.

Data: `--config.env.train.gsm8k.kwargs.path=/path/to/train.jsonl` (the `{"question","answer"}` JSONL format),
or leave the path empty to load through TFDS (`tfds.load("gsm8k")`, needs TensorFlow and network once).
"""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.train = {"gsm8k": env_spec("posttrain/GSM8K-v0", split="train", path="")}
    c.env.eval = {"gsm8k": env_spec("posttrain/GSM8K-v0", split="test", path="")}
    c.sampling.max_new_tokens = 256
    c.eval.max_new_tokens = 256
    c.eval.num_tasks = 100
    # 8 packed rows of up to 8 x 256 completion tokens: no remat peaks at 19.6 GiB compiled (over 90% of 24 GB with
    # the process around it); saving matmul outputs only and 2 microbatches: 8.2 GiB at 256 prompt tokens
    c.model.remat = "dots"
    c.rl.num_microbatches = 2
    c.train.preflight_prompt_len = 256
    c.rl.loss = "ppo"
    c.rl.eps_high = 0.28
    c.optim.lr = 1e-6
    c.train.steps = 200
    c.train.workdir = "runs/gsm8k"
    return c
