"""GRPO on a mix of easy reasoning-gym domains (ten candidates) with the SmolLM2-135M-Instruct policy on a CPU.

Domains are selected through the registry (`envs.tasks.domains.select`): each entry is a pattern with a weight and
dataset-config overrides that make the tasks easy enough for a 135M model (one-digit sums and products, small
GCD/LCM/bit counts, short words and texts, so that it solves some but not all of each at T=0.7; the library's
curriculum level 0 is harder than that); only golden-verified domains that the gaming-floor table does not flag
are kept (`envs.tasks.floors`: a floor >= 0.2, the best mean reward of a reply without a solution, or a failing
golden sample; with these configs gcd, count_bits, letter_counting and simple_equations pay >= 0.2 for a constant
answer and are left out; an entry's ``"allow_flagged": True`` would keep one). `posttrain domains
--floors` prints floors and golden samples. The prompt ends with `SHORT_INSTRUCTION` (the long one makes SmolLM2
echo its words); replies without tags are read by the env's last-line fallback ("The answer is 12.", "3 * 4 = 12").
Train tasks: 10000 per domain (seed 0); eval: the held-out test split (seed 0 + `TEST_SEED_OFFSET`; its questions
never occur in training), greedy, scored by the env (each dataset's own scorer): `eval/<domain>/pass@1`.
A step is 4 prompts x 8 samples x <= 64 tokens; training stops after 20 minutes.
Run: posttrain train --config=configs/reasoning_mix.py [--config.env.domains='reasoning_gym/gcd,reasoning_gym/l*']
"""
from envs.tasks import domains
from envs.tasks import reasoning_gym as rg_env
from posttrain.config import default_config, env_spec

EASY_CONFIGS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-", "*"],
                         "allow_parentheses": False, "allow_negation": False},
    "products": {"min_digits": 1, "max_digits": 1},
    "gcd": {"max_value": 50},
    "lcm": {"max_value": 15},
    "count_bits": {"max_n": 255},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "letter_counting": {"min_words": 1, "max_words": 3},
    "spell_backward": {"max_word_len": 4},
    "simple_equations": {"min_terms": 2, "max_terms": 2, "max_value": 10},
}
ARITHMETIC = ("chain_sum", "basic_arithmetic", "products", "simple_equations")  # tasks.policies: filled first
EASY = [{"pattern": "reasoning_gym/" + name, "weight": 1.0, "config": config} for name, config in EASY_CONFIGS.items()]


def mix(entries, split, **kwargs):
    """{domain: env_spec} for the registry's selection of `entries` (see `envs.tasks.domains.select`)."""
    specs, _ = domains.select(entries, split=split, **kwargs)
    return {name: env_spec(s["id"], s["weight"], **s["kwargs"], instruction=rg_env.SHORT_INSTRUCTION)
            for name, s in specs.items()}


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.train = mix(EASY, "train", size=10_000, num_test=30)
    c.env.eval = mix(EASY, "test", size=10_000, num_test=30)
    c.rl.group_size = 8
    c.rl.prompts_per_step = 4           # 32 samples a step: a step well under a minute on 2 CPU cores
    c.rl.num_microbatches = 1           # 4 packed rows of ~600 tokens fit in ~3 GB without accumulation
    c.model.remat = "dots"              # as the quickstart: faster than no remat on CPU, less memory
    c.sampling.max_new_tokens = 64      # the answers are one short line; longer replies ramble and score 0
    c.sampling.temperature = 0.7       # at 1.0 SmolLM2 rambles off-topic on these prompts (0% on every domain)
    c.eval.max_new_tokens = 64
    c.eval.num_tasks = 30               # per domain (greedy)
    c.rl.loss = "ppo"
    c.rl.eps_high = 0.28
    c.optim.lr = 3e-5                   # the quickstart's schedule (SmolLM2 learns its arithmetic format with it)
    c.optim.schedule = "cosine"
    c.optim.min_lr_ratio = 0.1
    c.train.steps = 60
    c.train.max_train_seconds = 1150.0  # stop within 20 minutes of training (a step may end past it; evals not counted)
    c.train.workdir = "runs/reasoning_mix"
    c.checkpoint.every_steps = 30
    c.checkpoint.async_save = False     # on a CPU host an async save's host copy would overlap the next step's memory
    # Task scheduling (posttrain.scheduling.scheduler): the priorities and caps are a choice for this mix, each for a reason.
    c.tasks.enabled = True
    floor = {"min_share": 0.05}  # 0.2 of the 4 prompts a step (one group every 5 steps, by credit) for every domain,
    # whatever the priorities take: each keeps a training signal and a moving eval/<domain>/pass@1
    arithmetic = {**floor, "priority": 1, "max_share": 0.15}  # filled first: one answer format (a single integer)
    # that SmolLM2 learns within tens of steps (the quickstart), shared by these domains; the cap (0.6 of the 4 prompts
    # a step each) leaves the other domains the rest of every step
    c.tasks.policies = {"reasoning_gym/*": floor, **{f"reasoning_gym/{name}": arithmetic for name in ARITHMETIC
                                                     if f"reasoning_gym/{name}" in c.env.train}}  # those selected
    return c
