"""`posttrain plan --config=configs/plan/qwen3_30b_a3b.py[:lora] --target=...`: does a GRPO step of
qwen3-30b-a3b fit (see posttrain.config.dryrun_config for the batch and precision)? Experts split over 8 devices."""
from posttrain.config import dryrun_config


def get_config(variant: str = "full"):
    c = dryrun_config("qwen3-30b-a3b", variant or "full", mesh={"fsdp": -1, "expert": 8})
    c.train.machine = "v5p-64"  # README's plan table
    return c
