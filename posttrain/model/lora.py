"""LoRA helpers over flat parameter dicts: merge adapters into their base weights, count adapter parameters.

The adapters themselves live in the model (`posttrain.model.layers.add_adapters` / `project`): y = x W +
(alpha / r) (x A) B, so training computes no gradient for the frozen base W. `merge_adapters` folds them back
(W + (alpha / r) A @ B, reshaped to W's einsum shape) for export or for a plain, adapter-free model.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np


def merge_adapters(arrays: Mapping[tuple, np.ndarray], scale: float) -> dict:
    """{path: array} with every `<name>_lora_a` / `<name>_lora_b` pair folded into `<name>` and removed.

    scale: alpha / rank of the adapters. Stacked layers ([L, ...] leading axis) are handled per layer.
    Raises ValueError when an adapter has no matching base weight.
    """
    out = {k: v for k, v in arrays.items() if not k[-1].endswith(("_lora_a", "_lora_b"))}
    for path, a in arrays.items():
        if not path[-1].endswith("_lora_a"):
            continue
        name = path[-1][: -len("_lora_a")]
        base_path = path[:-1] + (name,)
        b = arrays[path[:-1] + (f"{name}_lora_b",)]
        if base_path not in out:
            raise ValueError(f"adapter {'/'.join(map(str, path))} has no base weight {name}")
        w = out[base_path]
        delta = np.einsum("...ir,...ro->...io", a.astype(np.float32), b.astype(np.float32)) * scale
        out[base_path] = (w.astype(np.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return out
