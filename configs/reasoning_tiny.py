"""A tiny random-init model on three reasoning-gym domains at curriculum level 0: the registry and
ReasoningGym-v0 through the whole loop in seconds (for tests; it learns nothing useful)."""
from envs.tasks import domains
from posttrain.config import default_config, env_spec

DOMAINS = [{"pattern": "reasoning_gym/chain_sum", "weight": 2.0, "level": 0},
           {"pattern": "reasoning_gym/basic_arithmetic,reasoning_gym/spell_backward", "weight": 1.0, "level": 0}]


def get_config():
    c = default_config()
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    for split in ("train", "eval"):
        specs, _ = domains.select(DOMAINS, split="train" if split == "train" else "test", size=200, num_test=10)
        setattr(c.env, split, {n: env_spec(s["id"], s["weight"], **s["kwargs"]) for n, s in specs.items()})
    c.rl.group_size = 4
    c.rl.prompts_per_step = 4
    c.sampling.max_new_tokens = 8
    c.optim.lr = 1e-3
    c.eval.num_tasks = 10
    c.eval.max_new_tokens = 8
    c.train.steps = 3
    c.train.workdir = "runs/reasoning_tiny"
    c.checkpoint.every_steps = 2
    return c
