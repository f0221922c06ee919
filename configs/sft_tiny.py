"""A tiny random-init model fine-tuned on 16 one-digit additions (inline chat records; no download): exercises
`posttrain sft` end to end in seconds. Held out: 4 other additions (held-out NLL and perplexity)."""
from posttrain.config.sft import default_sft_config


def addition(a: int, b: int) -> dict:
    """One TRL conversational record: a user question and the assistant's answer."""
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}


def get_config():
    c = default_sft_config()
    c.train.machine = "cpu-1:24GB"
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    pairs = [(a, b) for a in range(1, 9) for b in (2, 5)]  # 16 training conversations
    c.sft.train_examples = tuple(addition(a, b) for a, b in pairs)
    c.sft.eval_examples = tuple(addition(a, b) for a, b in ((1, 3), (4, 4), (6, 1), (9, 7)))
    c.sft.seq_len = 128
    c.sft.rows_per_step = 4
    c.sft.logprob_chunk = 128
    c.optim.lr = 3e-3
    c.train.steps = 8
    c.train.workdir = "runs/sft_tiny"
    c.checkpoint.every_steps = 4
    return c
