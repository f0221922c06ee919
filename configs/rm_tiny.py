"""A tiny random-init reward model trained on preference pairs of one-digit sums (the reply in the format
"a + b = c." chosen over "a + b is c", the same number of tokens; inline, no download): exercises `posttrain rm`
end to end in seconds. Held out: 8 other additions (pair accuracy and margin; the length-only baseline is at
chance here, 0.5: both replies of a pair have one length)."""
from posttrain.config.rm import default_rm_config


def addition_pair(a: int, b: int) -> dict:
    """One TRL preference record: the "=" format is chosen over the "is" format (same length)."""
    return {"id": f"{a}+{b}", "prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.",
            "rejected": f"{a} + {b} is {a + b}"}


def get_config():
    c = default_rm_config()
    c.train.machine = "cpu-1:24GB"
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    c.rm.train_examples = tuple(addition_pair(a, b) for a in range(1, 9) for b in (2, 3, 5, 6))  # 32 pairs
    c.rm.eval_examples = tuple(addition_pair(a, b) for a, b in ((1, 4), (2, 7), (3, 1), (4, 4), (5, 2), (6, 1),
                                                               (7, 3), (8, 1)))
    c.rm.pairs_per_step = 8
    c.optim.lr = 1e-2
    c.train.steps = 6
    c.train.workdir = "runs/rm_tiny"
    c.checkpoint.every_steps = 3
    return c
