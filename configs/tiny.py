"""A tiny random-init model on Arithmetic-v0 (single-digit addition): exercises the whole loop in seconds."""
from posttrain.config.tiny import tiny_base


def get_config():
    return tiny_base("tiny-dense", workdir="runs/tiny")
