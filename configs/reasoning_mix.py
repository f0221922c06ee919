"""GRPO on a mix of ten easy reasoning-gym domains (issue 16) with the default SmolLM2-135M-Instruct policy.

Domains are selected through the registry (`envs.domains.select`): each entry is a pattern with a weight and a
curriculum level (0 = the library's easiest); only golden-verified domains are kept (the left-out ones are
printed by `posttrain domains`). Train tasks: 10000 per domain (seed 0); eval: the held-out test split (seed
0 + `envs.reasoning_gym.TEST_SEED_OFFSET`), scored by the env (each dataset's own scorer, partial credit).
Run: posttrain train --config=configs/reasoning_mix.py [--config.train.steps=...]
"""
from envs import domains
from posttrain.config import default_config, env_spec

EASY = [{"pattern": "reasoning_gym/" + name, "weight": 1.0, "level": 0} for name in (
    "chain_sum", "basic_arithmetic", "products", "gcd", "lcm", "count_bits", "decimal_chain_sum",
    "simple_equations", "letter_counting", "spell_backward")]


def mix(entries, split, **kwargs):
    """{domain: env_spec} for the registry's selection of `entries` (see `envs.domains.select`)."""
    specs, _ = domains.select(entries, split=split, **kwargs)
    return {name: env_spec(s["id"], s["weight"], **s["kwargs"]) for name, s in specs.items()}


def get_config():
    c = default_config()
    c.env.train = mix(EASY, "train", size=10_000, num_test=50)
    c.env.eval = mix(EASY, "test", size=10_000, num_test=50)
    c.rl.group_size = 8
    c.rl.prompts_per_step = 16
    # 16 packed rows of ~1,700 tokens: without remat and accumulation the first update took 24 GB and was killed on
    # the 2-core, 24 GB CPU machine; 8 microbatches of 2 rows with matmul outputs kept (as the quickstart does)
    c.rl.num_microbatches = 8
    c.model.remat = "dots"
    c.sampling.max_new_tokens = 192
    c.sampling.temperature = 1.0
    c.eval.max_new_tokens = 192
    c.eval.num_tasks = 20
    c.rl.loss = "ppo"
    c.rl.eps_high = 0.28
    c.optim.lr = 1e-6
    c.train.steps = 200
    c.train.workdir = "runs/reasoning_mix"
    return c
