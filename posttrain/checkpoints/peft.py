"""LoRA adapters -> a PEFT adapter directory (`peft.PeftModel.from_pretrained(base_model, DIR)` loads it).

Format (peft `LoraConfig` / `save_pretrained`, https://huggingface.co/docs/peft):
  adapter_config.json          {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r", "lora_alpha",
                               "target_modules": [every adapted module's full name], ...}
  adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight [out, r]
PEFT computes y = x W^T + (lora_alpha / r) x A^T B^T, posttrain y = x W + (alpha / r) (x a) b with a [in, r] and
b [r, out] (`posttrain.model.layers.project`), so A = a^T and B = b^T up to HF's row order. That order (head
reshapes, DeepSeek's interleaved rotary rows) is read off the same `checkpoints.hf` rule that exports the base
weight: the rule is applied to an array of flat indices, which gives the permutation of W's input and output
features in the HF tensor.

MoE families: peft (0.21, `utils/transformers_weight_conversion.py`) rewrites any `gate_proj` / `up_proj` /
`down_proj` target of a qwen2_moe-style model (Qwen3-MoE, DeepSeek-V3, Mixtral) into the routed experts' fused
parameters, so adapters on their dense or shared-expert MLPs cannot be expressed: `export_peft` refuses them
(export merged with `export_hf`, or adapt attention only).

Dimension legend: r adapter rank; I / O flattened input / output features of a projection.
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
    """(out_order [O_hf], in_order [I_hf]): HF row o holds our flat output feature out_order[o], HF column i our
    flat input feature in_order[i], for a weight of our shape `w_shape` whose first dims multiply to `n_in`."""
    n_out = math.prod(w_shape) // n_in
    idx = np.arange(math.prod(w_shape), dtype=np.int64).reshape(w_shape)
    hf = rule.to_hf([idx])[0]
    if hf.ndim != 2:
        raise ValueError(f"{rule.hf[0]}: adapters are exported only for 2-D HF weights, got shape {hf.shape}")
    return hf[:, 0] % n_out, hf[0, :] // n_out


def adapter_tensors(cfg: ModelConfig, arrays: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} for every `<name>_lora_a` / `<name>_lora_b` pair in `arrays` (flat param dict).

    Raises ValueError when an adapter's base weight has no single-tensor HF rule (nothing to attach it to).
    """
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
    """Writes the LoRA adapters of `state` (an nnx State of a model built with `cfg.lora`) as a PEFT directory.

    dtype: float32 | bfloat16 | float16 of the written tensors (default cfg.param_dtype); base_model: recorded as
    `base_model_name_or_path` (e.g. the directory `export_hf` wrote the merged-free base to).
    Raises ValueError when cfg has no adapters or an adapter cannot be placed (named).
    """
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
