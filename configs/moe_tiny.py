"""A tiny random-init Mixture-of-Experts model (DeepSeek-style: MLA, shared expert, sigmoid group-limited routing
with the aux-loss-free bias) through the whole loop. On a multi-device host add e.g. --config.mesh.expert=2."""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.model.preset = "tiny-deepseek"
    c.model.overrides = {"vocab_size": 320}
    c.env.train = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="train", digits=1, num_test=20)}
    c.env.eval = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="test", digits=1, num_test=20)}
    c.rl.group_size = 4
    c.rl.prompts_per_step = 4
    c.sampling.max_new_tokens = 8
    c.optim.lr = 1e-3
    c.eval.num_tasks = 20
    c.eval.max_new_tokens = 8
    c.train.steps = 3
    c.train.workdir = "runs/moe_tiny"
    c.checkpoint.every_steps = 2
    return c
