"""`posttrain plan --config=configs/plan/kimi_k2.py[:lora] --target=...`: does a GRPO step of
kimi-k2-1t fit (see posttrain.config.plan_config for the batch and precision)? Experts split over 8 devices,
the MLA latent projections over fsdp (`MLA_LATENTS_OVER_FSDP`)."""
from posttrain.config import MLA_LATENTS_OVER_FSDP, plan_config


def get_config(variant: str = "full"):
    return plan_config("kimi-k2-1t", variant or "full", mesh={"fsdp": -1, "expert": 8},
                       rules=MLA_LATENTS_OVER_FSDP)
