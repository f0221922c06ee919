"""`posttrain plan --config=configs/plan/deepseek_v3.py[:lora] --target=...`: does a GRPO step of
deepseek-v3-671b fit (see posttrain.config.dryrun_config for the batch and precision)? Experts split over 8 devices,
the MLA latent projections over fsdp (`MLA_LATENTS_OVER_FSDP`)."""
from posttrain.config import MLA_LATENTS_OVER_FSDP, dryrun_config


def get_config(variant: str = "full"):
    c = dryrun_config("deepseek-v3-671b", variant or "full", mesh={"fsdp": -1, "expert": 8},
                      rules=MLA_LATENTS_OVER_FSDP)
    c.train.machine = "h200x256"  # README's plan table
    return c
