"""`posttrain plan --config=configs/plan/kimi_k2.py[:lora] --target=...`: does a GRPO step of
kimi-k2-1t fit (see posttrain.config.dryrun_config for the batch and precision)? Experts split over 8 devices,
the MLA latent projections over fsdp (`MLA_LATENTS_OVER_FSDP`); full fine-tuning keeps float32 master weights and
Adam moments but takes the layers' gradients in bfloat16 (`model.grad_dtype=compute`)."""
from posttrain.config import MLA_LATENTS_OVER_FSDP, dryrun_config


def get_config(variant: str = "full"):
    c = dryrun_config("kimi-k2-1t", variant or "full", mesh={"fsdp": -1, "expert": 8}, rules=MLA_LATENTS_OVER_FSDP)
    if (variant or "full") == "full":
        c.model.grad_dtype = "compute"  # bf16 layer gradients: float32 ones (16 GiB per chip) do not fit v5p-512
    c.train.machine = "v5p-512" if (variant or "full") == "full" else "v5p-128"  # README's plan table
    return c
