"""`posttrain plan --config=configs/plan/deepseek_v3.py[:lora] --target=... --prompt_len=512`: does a GRPO step of
deepseek-v3-671b fit (see posttrain.config.plan_config for the batch and precision)? Experts split over 8 devices; the MLA
latent projections (logical axes q_lora / kv_lora, replicated by default) are split over fsdp by `mesh.rules`:
replicated, DeepSeek-V3's q_b_proj alone took 8 GiB of float32 weights per device (and as much again per Adam
moment and gradient)."""
from posttrain.config import plan_config


def get_config(variant: str = "full"):
    return plan_config("deepseek-v3-671b", variant or "full", mesh={"fsdp": -1, "expert": 8},
                       rules={"q_lora": "fsdp", "kv_lora": "fsdp"})
