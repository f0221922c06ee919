"""A tiny random-init model on three reasoning-gym domains at curriculum level 0: the registry and
ReasoningGym-v0 through the whole loop in seconds (for tests; it learns nothing useful)."""
from envs.tasks import domains
from posttrain.config import env_spec
from posttrain.config.tiny import tiny_base

DOMAINS = [{"pattern": "reasoning_gym/chain_sum", "weight": 2.0, "level": 0},
           {"pattern": "reasoning_gym/basic_arithmetic,reasoning_gym/spell_backward", "weight": 1.0, "level": 0}]


def get_config():
    c = tiny_base("tiny-dense", workdir="runs/reasoning_tiny")
    for split in ("train", "eval"):
        specs, _ = domains.select(DOMAINS, split="train" if split == "train" else "test", size=200, num_test=10)
        setattr(c.env, split, {n: env_spec(s["id"], s["weight"], **s["kwargs"]) for n, s in specs.items()})
    c.eval.num_tasks = 10
    return c
