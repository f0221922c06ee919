"""A tiny random-init model trained by DPO to prefer correct one-digit sums (inline preference pairs; no download):
exercises `posttrain dpo` end to end in seconds. Held out: 4 other additions (pair accuracy and margin)."""
from posttrain.config.dpo import default_dpo_config


def addition_pair(a: int, b: int) -> dict:
    """One TRL preference record: the right sum is chosen, the sum plus one rejected."""
    return {"id": f"{a}+{b}", "prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.",
            "rejected": f"{a} + {b} = {a + b + 1}."}


def get_config():
    c = default_dpo_config()
    c.train.machine = "cpu-1:24GB"
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    c.dpo.train_examples = tuple(addition_pair(a, b) for a in range(1, 9) for b in (2, 5))  # 16 pairs
    c.dpo.eval_examples = tuple(addition_pair(a, b) for a, b in ((1, 3), (4, 4), (6, 1), (9, 7)))
    c.dpo.pairs_per_step = 4
    c.dpo.logprob_chunk = 64
    c.optim.lr = 1e-2
    c.dpo.beta = 0.5
    c.train.steps = 12
    c.train.workdir = "runs/dpo_tiny"
    c.checkpoint.every_steps = 4
    return c
