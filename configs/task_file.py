"""GRPO on a task file of your own (JSONL, CSV or Parquet rows of prompt + answer), no Python: the file's train rows
train, its test rows (a `split` column, else a stable 10% of the rows) are the held-out evaluation.

Run: posttrain train --config=configs/task_file.py:tasks.csv [--config.env.train.tasks.kwargs.verifier=numeric]
Check the file first: posttrain tasks check tasks.csv. The walk-through: docs/task_files.md.
"""
from posttrain.config import default_config


def get_config(path: str = ""):
    if not path:
        raise ValueError("configs/task_file.py needs the task file after a colon: "
                         "--config=configs/task_file.py:PATH.jsonl (or .csv, .parquet)")
    c = default_config()
    c.train.machine = "cpu-1:24GB"
    c.env.train = {"tasks": {"path": path, "weight": 1.0, "id": "", "kwargs": {"split": "train", "verifier": "exact"}}}
    c.env.eval = {"tasks": {"path": path, "weight": 1.0, "id": "", "kwargs": {"split": "test", "verifier": "exact"}}}
    c.rl.group_size = 8
    c.rl.prompts_per_step = 8
    c.optim.lr = 3e-5
    c.optim.schedule = "cosine"
    c.optim.min_lr_ratio = 0.1
    c.sampling.max_new_tokens = 128
    c.eval.scorer = "env"
    c.model.remat = "dots"
    c.rl.num_microbatches = 2
    c.train.steps = 24
    c.train.workdir = "runs/task_file"
    c.checkpoint.every_steps = 12
    c.checkpoint.async_save = False
    return c
