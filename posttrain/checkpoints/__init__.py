"""Checkpoint formats: HF safetensors and GGUF import (`load_pretrained`), HF export, Orbax train state."""
from posttrain.checkpoints.load import Pretrained, load_pretrained
from posttrain.checkpoints.export import export_hf

__all__ = ["Pretrained", "export_hf", "load_pretrained"]
