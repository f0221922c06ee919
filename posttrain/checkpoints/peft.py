"""LoRA adapters -> a PEFT adapter directory (format and MoE restriction: docs/checkpoint_formats.md).

Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from posttrain.checkpoints import hf as hf_lib
from posttrain.checkpoints.export import _np_dtype, flat_arrays, write_safetensors
from posttrain.model.config import ModelConfig

PREFIX = "base_model.model."
_MLP = ("gate_proj", "up_proj", "down_proj")


def _feature_order(rule, w_shape: tuple[int, ...], n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(out_order, in_order): our flat feature of each HF row and column of a weight of our shape `w_shape`."""
    n_out = math.prod(w_shape) // n_in
    idx = np.arange(math.prod(w_shape), dtype=np.int64).reshape(w_shape)
    hf = rule.to_hf([idx])[0]
    if hf.ndim != 2:
        raise ValueError(f"{rule.hf[0]}: adapters are exported only for 2-D HF weights, got shape {hf.shape}")
    return hf[:, 0] % n_out, hf[0, :] // n_out


def adapter_tensors(cfg: ModelConfig, arrays: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} of every `*_lora_a` / `*_lora_b` pair; ValueError for a base without an HF tensor."""
    family = hf_lib.hf_family(cfg)
    out = {}
    for stack, first, num, is_moe in hf_lib.block_layout(cfg):
        rules = {r.ours[0]: r for r in hf_lib.layer_table(cfg, family, is_moe) if len(r.ours) == 1}
        for path, a_LxIxr in arrays.items():
            if path[0] != stack or not path[-1].endswith("_lora_a"):
                continue
            base = path[:-1] + (path[-1][: -len("_lora_a")],)
            b_LxRxO = arrays[path[:-1] + (base[-1] + "_lora_b",)]
            key = ".".join(base[1:])
            if key not in rules or base not in arrays:
                raise ValueError(f"adapter {'/'.join(path)}: no HF tensor for its base weight {key!r}")
            rule = rules[key]
            out_order, in_order = _feature_order(rule, arrays[base].shape[1:], a_LxIxr.shape[1])
            module = rule.hf[0].removesuffix(".weight")
            for i in range(num):
                name = f"{PREFIX}model.layers.{first + i}.{module}"
                out[f"{name}.lora_A.weight"] = a_LxIxr[i].T[:, in_order]
                out[f"{name}.lora_B.weight"] = b_LxRxO[i].T[out_order]
    return out


def export_peft(cfg: ModelConfig, state, out_dir, *, dtype: str | None = None,
                base_model: str | None = None) -> pathlib.Path:
    """Writes the LoRA adapters of `state` as a PEFT directory (base_model: its `base_model_name_or_path`).

    dtype: float32 | bfloat16 | float16 of the tensors (default cfg.param_dtype). Raises ValueError when cfg has no
    adapters or an adapter cannot be expressed (named)."""
    if cfg.lora is None or not cfg.lora.rank:
        raise ValueError("export_peft: the model config has no LoRA adapters (lora.rank == 0)")
    tensors = adapter_tensors(cfg, flat_arrays(state))
    mlp = sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[1] for n in tensors} & set(_MLP))
    if cfg.moe is not None and mlp:
        raise ValueError(f"export_peft: adapters on {mlp} of an MoE model cannot be loaded by peft (it maps those "
                         "names to the routed experts); export merged weights with export_hf, or use attention-only "
                         "lora.targets")
    if not tensors:
        raise ValueError("export_peft: the state holds no *_lora_a / *_lora_b parameters")
    np_dtype = _np_dtype(dtype or cfg.param_dtype)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({n[len(PREFIX):].rsplit(".lora_", 1)[0] for n in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "base_model_name_or_path": base_model}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    write_safetensors({n: a.astype(np_dtype) for n, a in tensors.items()}, out, max_shard_bytes=1 << 62,
                      prefix="adapter_model")
    return out
