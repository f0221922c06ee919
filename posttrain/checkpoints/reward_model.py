"""A reward model (`posttrain.model.reward_head.RewardModel`) as a transformers sequence-classification directory.

Written by `export_reward_model`, read by `load_reward_model` and transformers; layout: docs/checkpoint_formats.md.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from posttrain.checkpoints import hf as hf_lib
from posttrain.checkpoints import hf_config as hf_config_lib
from posttrain.checkpoints.export import _np_dtype, flat_arrays, save_tokenizer, write_safetensors
from posttrain.infra import mesh as mesh_lib
from posttrain.model.config import ModelConfig

RUN_SUBDIR = "reward_model"  # where `posttrain rm` writes its export inside the run directory
_ARCHS = {"llama": "LlamaForSequenceClassification", "mistral": "MistralForSequenceClassification",
          "qwen2": "Qwen2ForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
          "qwen3_moe": "Qwen3MoeForSequenceClassification", "mixtral": "MixtralForSequenceClassification"}


def export_pad_id(tokenizer) -> int:
    """The exported `pad_token_id`: the first of pad, unk and 0 that is no stop id; ValueError when none is."""
    stops = set(int(i) for i in tokenizer.stop_ids)
    unk = tokenizer.special_tokens.get("unk_token")
    candidates = [tokenizer.pad_id, None if unk is None else tokenizer.backend.token_to_id(unk), 0]
    for c in candidates:
        if c is not None and int(c) not in stops:
            return int(c)
    raise ValueError(f"no pad_token_id for the export: pad, unk and 0 are all stop ids {sorted(stops)}")


def export_reward_model(cfg: ModelConfig, state, out_dir, *, tokenizer=None, dtype: str | None = None,
                        max_shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Writes the directory for backbone config `cfg` and the `RewardModel`'s nnx `state`.

    dtype: float32 | bfloat16 | float16 (default cfg.param_dtype). Raises ValueError for an unsupported dtype, a
    family without a sequence-classification class, or a LoRA backbone."""
    mt = hf_config_lib.hf_family(cfg)
    if mt not in _ARCHS:
        raise ValueError(f"a {mt!r} backbone has no transformers sequence-classification export; families: "
                         f"{sorted(_ARCHS)}")
    if cfg.lora is not None and cfg.lora.rank:
        raise ValueError("export_reward_model takes a full-weight reward model (lora.rank = 0)")
    dtype = dtype or cfg.param_dtype
    np_dtype = _np_dtype(dtype)
    extra = {}
    if tokenizer is not None:
        extra = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                 "pad_token_id": export_pad_id(tokenizer)}
    hf = hf_config_lib.config_to_hf(cfg, dtype=dtype, **extra)
    hf.update(architectures=[_ARCHS[mt]], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
              problem_type="regression")
    arrays = flat_arrays(state)
    backbone = {k[1:]: v for k, v in arrays.items() if k[0] == "backbone"}
    tensors = {n: a for n, a in hf_lib.arrays_to_hf(cfg, backbone).items() if n != "lm_head.weight"}
    tensors["score.weight"] = arrays[("head", "score")].reshape(cfg.d_model, 1).T
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    write_safetensors({n: np.asarray(a).astype(np_dtype) for n, a in tensors.items()}, out, max_shard_bytes)
    if tokenizer is not None:  # its pad token is the config's pad_token_id: `tokenizer(..., padding=True)` then
        # pads with what transformers' pooling skips (SmolLM2's own pad, <|im_end|>, ends every reply)
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_position,
                       pad_token=tokenizer.backend.id_to_token(extra["pad_token_id"]))
    return out


def reward_model_dir(path) -> pathlib.Path:
    """`path`, or `<path>/reward_model` for a `posttrain rm` run.

    Raises FileNotFoundError when neither holds a config.json, ValueError when it is no single-score classifier."""
    path = pathlib.Path(path)
    d = path if (path / "config.json").is_file() and not (path / RUN_SUBDIR).is_dir() else path / RUN_SUBDIR
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no reward model (neither {path}/config.json nor {path}/{RUN_SUBDIR}/; "
                                "`posttrain rm` writes one at the end of its run)")
    hf = json.loads((d / "config.json").read_text())
    archs = hf.get("architectures") or []
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels")
    if not any(a.endswith("ForSequenceClassification") for a in archs) or labels != 1:
        raise ValueError(f"{d}/config.json: architectures={archs}, labels={labels}: a reward model is a "
                         "*ForSequenceClassification with one label")
    return d


def load_reward_model(path, *, mesh=None, rules=mesh_lib.RULES, **fields):
    """(backbone ModelConfig, graphdef, state, tokenizer or None) of the `RewardModel` in `path`, placed on `mesh`.

    fields: ModelConfig fields replaced. Raises as `reward_model_dir`, and ValueError for a bad tensor (named)."""
    import dataclasses

    from posttrain.checkpoints.load import SafetensorsDir, place
    from posttrain.model.reward_head import with_head

    d = reward_model_dir(path)
    hf = json.loads((d / "config.json").read_text())
    cfg = dataclasses.replace(hf_lib.config_from_hf(hf, dtype=fields.pop("dtype", None),
                                                    param_dtype=fields.pop("param_dtype", None)), **fields)
    tensors = SafetensorsDir(d)
    if "score.weight" not in tensors or tuple(tensors.shape("score.weight")) != (1, cfg.d_model):
        raise ValueError(f"{d}: expected a score.weight of shape (1, {cfg.d_model}) (one label over the hidden size)")
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:  # the head replaces the unembedding
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    used = {"score.weight"}
    mesh = mesh if mesh is not None else mesh_lib.make_mesh({"fsdp": 1}, __import__("jax").devices()[:1])
    graphdef, state = place(cfg, lambda expected: hf_lib.hf_to_arrays(cfg, tensors, expected, used=used), mesh, rules)
    hf_lib.check_unused(tensors.keys(), used, cfg.num_layers)
    graphdef, state = with_head(cfg, graphdef, state, mesh, rules, score=np.asarray(tensors["score.weight"]))
    tokenizer = None
    if (d / "tokenizer.json").is_file():
        from posttrain.model.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(d)
    return cfg, graphdef, state, tokenizer
