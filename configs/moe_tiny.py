"""A tiny random-init Mixture-of-Experts model (DeepSeek-style: MLA, shared expert, sigmoid group-limited routing
with the aux-loss-free bias) through the whole loop. On a multi-device host add e.g. --config.mesh.expert=2."""
from posttrain.config.tiny import tiny_base


def get_config():
    return tiny_base("tiny-deepseek", workdir="runs/moe_tiny")
