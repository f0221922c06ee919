"""A tiny evaluation suite for tests: one-digit arithmetic (the tiny config's held-out split) greedy and sampled
(n = 4, pass@2), one reasoning-gym domain, and GSM8K pointed at a file that does not exist (listed as skipped).

Run: posttrain eval --suite=configs/eval/tiny.py --checkpoint=runs/tiny --baseline=base
"""
from envs.tasks import reasoning_gym as rg_env

ARITHMETIC = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}, "scorer": "last_integer",
              "format": "number"}


def get_suite():
    return {
        "name": "tiny",
        "alpha": 0.05,
        "defaults": {"split": "test", "tasks": 6, "n": 1, "temperature": 0.0, "max_new_tokens": 6},
        "areas": {
            "arithmetic": {"trained": True, "domains": {
                "arithmetic": ARITHMETIC,
                "arithmetic_sampled": {**ARITHMETIC, "tasks": 3, "n": 4, "k": [2], "temperature": 1.0},
            }},
            "logic": {"domains": {
                "reasoning_gym/chain_sum": {"tasks": 3, "format": "answer_tag",
                                            "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
                                            "kwargs": {"instruction": rg_env.SHORT_INSTRUCTION}},
            }},
            "math word problems": {"domains": {
                "gsm8k": {"env": "posttrain/GSM8K-v0", "kwargs": {"path": "/nonexistent/gsm8k"}, "format": "hash"},
            }},
        },
    }
