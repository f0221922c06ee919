"""posttrain: JAX-native post-training (GRPO with verifiable rewards) for language models.

Importing it registers the built-in gymnasium env ids (`posttrain/Arithmetic-v0`, ...). Public API, re-exported lazily:

  load_pretrained, export_hf, Transformer, ModelConfig, get_preset    models from GGUF / HF and back; the NNX decoder
  SamplingParams, sample, pad_prompts                                 the jitted KV-cache sampler
  ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, policy_loss, token_logprobs    the GRPO math, by name
  Config, from_config_dict, default_config, make_run_plan, RunPlan, PrecisionPolicy      configuration and run plan
  train, GRPOTrainer                                                  the training loop; the same run step by step"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load_pretrained": "posttrain.checkpoints", "export_hf": "posttrain.checkpoints.export",
    "Transformer": "posttrain.model.transformer", "ModelConfig": "posttrain.model.config",
    "get_preset": "posttrain.model.presets",
    "SamplingParams": "posttrain.generate.sampler", "sample": "posttrain.generate.sampler", "pad_prompts": "posttrain.generate.sampler",
    "ADVANTAGES": "posttrain.algos.grpo.advantages", "POLICY_LOSSES": "posttrain.algos.grpo.losses", "KL_ESTIMATORS": "posttrain.algos.grpo.losses",
    "AGGREGATIONS": "posttrain.algos.grpo.losses", "policy_loss": "posttrain.algos.grpo.losses", "token_logprobs": "posttrain.learn.logprobs",
    "Config": "posttrain.config", "from_config_dict": "posttrain.config", "default_config": "posttrain.config",
    "make_run_plan": "posttrain.config.plan", "RunPlan": "posttrain.config.plan", "PrecisionPolicy": "posttrain.infra.precision",
    "train": "posttrain.recipes.grpo", "GRPOTrainer": "posttrain.recipes.trainer",
}
__all__ = sorted(_EXPORTS)

from posttrain import _moved  # noqa: E402  (old module paths: deprecated aliases of the new ones)

_moved.install()
importlib.import_module("envs")  # registers the posttrain/*-v0 ids with gymnasium (idempotent)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
