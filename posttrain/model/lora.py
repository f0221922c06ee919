"""LoRA over flat parameter dicts: fold adapters into their base weights (W + (alpha / r) A @ B) for export."""
from __future__ import annotations

from typing import Mapping

import numpy as np


def merge_adapters(arrays: Mapping[tuple, np.ndarray], scale: float) -> dict:
    """{path: array} with each `<name>_lora_a` / `_lora_b` pair folded into `<name>` (scale: alpha / rank).

    Stacked [L, ...] layers merge per layer. Raises ValueError for an adapter without a base weight."""
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
