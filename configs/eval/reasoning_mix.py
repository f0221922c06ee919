"""The evaluation suite of `configs/reasoning_mix.py`'s gate: each of its ten candidate reasoning-gym domains on 100
held-out tasks (greedy, the run's 64-token budget and short instruction, the same easy dataset configs).

Trained: the six domains the mix keeps. Untrained (watched for regressions only): the four that the gaming-floor
table leaves out of the mix (gcd, count_bits, letter_counting, simple_equations pay >= 0.2 for a constant reply, so
their reward cannot train, but a policy trained on the others can still unlearn them). At 100 tasks per domain an
exact McNemar test at alpha 0.05 (Holm over ten domains) needs roughly 12 or more discordant pairs, all one way,
to call a regression; the comparison prints the minimum detectable effect.

Run (the gate in the loop): posttrain train --config=configs/reasoning_mix.py
    --config.eval.suite=configs/eval/reasoning_mix.py --config.eval.every_steps=20
Run (after the fact): posttrain eval --suite=configs/eval/reasoning_mix.py --checkpoint=runs/reasoning_mix
    --baseline=base
"""
import importlib.util
import pathlib

from envs.tasks import reasoning_gym as rg_env

_SPEC = importlib.util.spec_from_file_location("reasoning_mix_config",
                                               pathlib.Path(__file__).resolve().parents[1] / "reasoning_mix.py")
MIX = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(MIX)

UNTRAINED = ("gcd", "count_bits", "letter_counting", "simple_equations")  # flagged by the floor table
AREAS = {"arithmetic": ("chain_sum", "basic_arithmetic", "products", "simple_equations"),
         "number theory": ("gcd", "lcm", "count_bits"),
         "counting and words": ("leg_counting", "letter_counting", "spell_backward")}


def get_suite():
    def domain(name):
        return {"config": MIX.EASY_CONFIGS[name], "kwargs": {"instruction": rg_env.SHORT_INSTRUCTION},
                "trained": name not in UNTRAINED}

    return {
        "name": "reasoning_mix",
        "alpha": 0.05,
        "defaults": {"split": "test", "tasks": 100, "n": 1, "temperature": 0.0, "max_new_tokens": 64,
                     "scorer": "env", "format": "answer_tag"},
        "areas": {area: {"domains": {f"reasoning_gym/{n}": domain(n) for n in names}}
                  for area, names in AREAS.items()},
    }
