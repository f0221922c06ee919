"""Export posttrain weights as a complete Hugging Face model directory (`export_hf`) and the writers `peft` reuses.

Directory layout: docs/checkpoint_formats.md. Tensor names and layouts come from `posttrain.checkpoints.hf`.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
from flax import nnx

from posttrain.checkpoints import hf as hf_lib
from posttrain.checkpoints import hf_config as hf_config_lib
from posttrain.model.config import ModelConfig
from posttrain.model.lora import merge_adapters

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def flat_arrays(state) -> dict[tuple, np.ndarray]:
    """{param path tuple: host numpy array} of an nnx State (arrays gathered from any sharding)."""
    return {k: np.asarray(jax.device_get(v.get_value() if isinstance(v, nnx.Variable) else v))
            for k, v in nnx.to_flat_state(state)}


def _np_dtype(name: str):
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r} is not supported; expected one of {EXPORT_DTYPES}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def write_safetensors(tensors: dict[str, np.ndarray], out: pathlib.Path, max_shard_bytes: int,
                      prefix: str = "model") -> list[str]:
    """Writes `<prefix>.safetensors`, or shards of at most `max_shard_bytes` and an index; returns the file names.

    A tensor larger than `max_shard_bytes` gets a shard of its own."""
    from safetensors.numpy import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards, cur, size = [], {}, 0
    for n in sorted(tensors):
        if cur and size + tensors[n].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = np.ascontiguousarray(tensors[n])
        size += tensors[n].nbytes
    shards.append(cur)
    if len(shards) == 1:
        _save(save_file, shards[0], out / f"{prefix}.safetensors")
        return [f"{prefix}.safetensors"]
    weight_map, names = {}, []
    for i, shard in enumerate(shards):
        name = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(save_file, shard, out / name)
        weight_map.update({n: name for n in shard})
        names.append(name)
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))}, "weight_map": weight_map}
    (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def _save(save_file, tensors: dict, path: pathlib.Path) -> None:
    """safetensors' `save_file`, then the umask's file mode: safetensors writes 0o600, unreadable to other users."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read from /proc where it can be (os.umask sets it for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def save_tokenizer(tokenizer, out_dir, *, model_max_length: int | None = None,
                   pad_token: str | None = None) -> list[str]:
    """Writes a `Tokenizer`'s files for `transformers.AutoTokenizer` (`pad_token`: instead of its own); their names."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    special = dict(tokenizer.special_tokens)
    if pad_token is not None:
        special["pad_token"] = pad_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False, **special}
    if model_max_length:
        config["model_max_length"] = model_max_length
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def generation_config(tokenizer) -> dict:
    """generation_config.json: bos / pad ids and every stop id (`Tokenizer.stop_ids`)."""
    stops = [int(i) for i in tokenizer.stop_ids]
    cfg = {"eos_token_id": stops if len(stops) > 1 else stops[0], "pad_token_id": int(tokenizer.pad_id)}
    if tokenizer.bos_id is not None:
        cfg["bos_token_id"] = int(tokenizer.bos_id)
    return cfg


def export_hf(cfg: ModelConfig, state, out_dir, *, tokenizer=None, dtype: str | None = None,
              max_shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Writes a complete HF model directory for `cfg` and its nnx `state`, LoRA adapters merged.

    Args:
      tokenizer: a `Tokenizer` (None: weights and config only, no generation_config.json).
      dtype: float32 | bfloat16 | float16 of the written tensors (default cfg.param_dtype).
    Raises:
      ValueError: an unsupported dtype or a config the HF family cannot express."""
    dtype = dtype or cfg.param_dtype
    np_dtype = _np_dtype(dtype)
    extra = {}
    if tokenizer is not None:
        extra = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf = hf_config_lib.config_to_hf(cfg, dtype=dtype, **extra)  # raises before anything is written
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = flat_arrays(state)
    if cfg.lora is not None and cfg.lora.rank:
        arrays = merge_adapters(arrays, cfg.lora.alpha / cfg.lora.rank)
    tensors = {n: a.astype(np_dtype) for n, a in hf_lib.arrays_to_hf(cfg, arrays).items()}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    write_safetensors(tensors, out, max_shard_bytes)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_position)
        (out / "generation_config.json").write_text(json.dumps(generation_config(tokenizer), indent=2))
    return out
