"""A tiny random-init model on RepoFix-v0 (the wiring of configs/repo_fix.py in seconds): two tasks x two samples
a step, up to 3 tool turns each, tool results masked out of the loss, rewards from the hidden tests. With the
byte tokenizer the first observation alone is ~3000 tokens; the policy learns nothing useful at 2 steps
(tests/posttrain/recipes/test_repo_fix_tiny.py drives it with a scripted policy)."""
from posttrain.config import env_spec
from posttrain.config.tiny import tiny_base

MAX_TURNS = 3


def get_config():
    c = tiny_base("tiny-dense", workdir="runs/repo_fix_tiny")
    c.env.max_turns = MAX_TURNS
    c.env.train = {"repo_fix": env_spec("posttrain/RepoFix-v0", split="train", max_turns=MAX_TURNS,
                                        max_output_chars=400)}
    c.env.eval = {}
    c.rl.packed = False
    c.rl.prompts_per_step = 2
    c.rl.group_size = 2
    c.sampling.max_new_tokens = 512  # a one-line inverse patch as one tool call fits
    c.train.steps = 2
    return c
