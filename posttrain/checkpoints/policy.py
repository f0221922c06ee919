"""Loading the policy a run starts from (a preset or a GGUF / HF checkpoint) on its mesh; the `model` section."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from flax import nnx

from posttrain.checkpoints import hub
from posttrain.checkpoints import load as load_lib
from posttrain.checkpoints import load_pretrained
from posttrain.checkpoints.gguf import default_model_path
from posttrain.errors import POSITIVE, FieldError, check_fields
from posttrain.infra.partitioning import assert_sufficiently_sharded, create_sharded
from posttrain.infra.precision import DTYPES, PRECISIONS
from posttrain.model.attention_kernels import IMPLS as ATTENTION_IMPLS
from posttrain.model.config import GRAD_DTYPES, REMAT_MODES, REMAT_NAMES, ModelConfig
from posttrain.model.gmm import IMPLS as GMM_IMPLS
from posttrain.model.presets import PRESETS, get_preset
from posttrain.model.tokenizer import Tokenizer
from posttrain.model.transformer import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySource:
    """Where the policy comes from and how it is built (`PolicySource.of` a run's config).

    Attributes:
        path: a .gguf file or HF model directory ("" with no preset: the default SmolLM2-135M-Instruct GGUF).
        preset: a `posttrain.model.presets` name (random init, byte tokenizer).
        overrides: preset fields replaced.
        seed: the preset's init seed.
        fields: `ModelConfig` fields set by the run, applied to a preset and to a checkpoint's config."""

    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, model: "ModelRunConfig", lora, precision, *, seed: int) -> "PolicySource":
        """The source a run's `model` and `lora` sections and its precision policy describe."""
        fields = dict(dtype=precision.compute_dtype, param_dtype=precision.param_dtype,
                      matmul_precision=precision.matmul_precision, remat=model.remat,
                      remat_names=tuple(model.remat_names), lora=lora if lora.rank else None,
                      moe_gmm_impl=model.moe_gmm_impl, moe_capacity_factor=model.moe_capacity_factor,
                      moe_ep_capacity_factor=model.moe_ep_capacity_factor, attention_impl=model.attention_impl,
                      grad_dtype=model.grad_dtype)
        return cls(path=model.path, preset=model.preset, overrides=dict(model.overrides), seed=seed, fields=fields)

    def check(self) -> None:
        """Checks the source without loading weights; ValueError naming the model.* key and what is allowed."""
        if self.preset:

            if self.preset not in PRESETS:
                raise ValueError(f"model.preset={self.preset!r} is unknown; presets: {sorted(PRESETS)}")
            fields = {f.name for f in dataclasses.fields(ModelConfig)}
            unknown = sorted(set(self.overrides) - fields)
            if unknown:
                raise ValueError(f"model.overrides: {unknown} are not ModelConfig fields; fields: {sorted(fields)}")
            try:
                cfg = self.preset_config()
            except ValueError as e:  # a value ModelConfig refuses
                raise ValueError(f"model.overrides={dict(self.overrides)}: {e}") from None
            vocab = Tokenizer.byte_level().vocab_size
            if cfg.vocab_size < vocab:
                raise ValueError(f"model.preset={self.preset!r} has vocab_size {cfg.vocab_size} < the {vocab} ids of "
                                 f"the byte tokenizer it uses; set model.overrides = {{'vocab_size': {vocab}}} (or "
                                 "more) in the config file")
            return
        try:
            load_lib.check_model_path(self.path or _default_model_path())
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"model.path={self.path!r}: {e}") from None
        if self.overrides:
            raise ValueError(f"model.overrides={dict(self.overrides)} apply to a model.preset only (a checkpoint's "
                             "shapes come from its file)")

    def preset_config(self) -> ModelConfig:
        """The preset's ModelConfig with the run's fields and the overrides. Raises ValueError without a preset."""
        if not self.preset:
            raise ValueError("no model.preset: shapes of a checkpoint come from its file (load_policy)")
        return get_preset(self.preset, **dict(self.fields), **dict(self.overrides))


def _default_model_path():
    return default_model_path()


def load_policy(source: PolicySource, mesh, rules):
    """(ModelConfig, graphdef, state, tokenizer) of `source`, its parameters sharded on `mesh` by `rules`.

    Raises ValueError for a source that fails `PolicySource.check` or has no tokenizer; AssertionError when the rules
    leave most of a large model replicated on a multi-device mesh."""
    source.check()
    if source.preset:
        mcfg = source.preset_config()
        tokenizer = Tokenizer.byte_level()
        graphdef, state = create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(source.seed)), mesh, rules)
        assert_sufficiently_sharded(state, mesh)
        return mcfg, graphdef, state, tokenizer
    pre = load_pretrained(source.path or None, mesh=mesh, rules=rules, **dict(source.fields))
    if pre.tokenizer is None:
        raise ValueError(f"{source.path}: no tokenizer found next to the weights (tokenizer.json)")
    assert_sufficiently_sharded(pre.state, mesh)
    return pre.config, pre.graphdef, pre.state, pre.tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    """The `model` section: `path`, `preset`, or neither (the default SmolLM2-135M-Instruct GGUF).

    Attributes:
        path: a GGUF file or a Hugging Face checkpoint directory ("": none).
        preset: a `posttrain.model.presets` name, randomly initialized, with the byte tokenizer ("": none).
        overrides: preset fields replaced, e.g. {"vocab_size": 320}.
        dtype: compute dtype (`posttrain.infra.precision`); "auto": float32 on CPU, bfloat16 on GPU/TPU.
        param_dtype: master-weight dtype; "auto": float32 (Adam moments follow it).
        matmul_precision: precision of every dot: default | high | highest.
        remat: what the backward pass keeps per layer: none | dots | names | full.
        remat_names: the activations kept under remat "names" (`posttrain.model.layers.CHECKPOINT_NAMES`).
        moe_gmm_impl: the grouped matmul of MoE experts: auto | ragged | padded | megablox.
        moe_capacity_factor: expert capacity factor (0: dropless).
        moe_ep_capacity_factor: the expert-parallel all-to-all capacity factor.
        attention_impl: self-attention of long packed rows: auto | blockwise | splash | pallas_gpu | dense.
        grad_dtype: gradients of the scanned layers' matrices: param (their dtype) | compute (half the memory; bf16)."""

    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str = "auto"
    param_dtype: str = "auto"
    matmul_precision: str = "default"
    remat: str = "none"
    remat_names: tuple[str, ...] = ("attn_out", "mlp_in")
    moe_gmm_impl: str = "auto"
    moe_capacity_factor: float = 0.0
    moe_ep_capacity_factor: float = 2.0
    attention_impl: str = "auto"
    grad_dtype: str = "param"

    def __post_init__(self):
        check_fields(self, choices={
            "remat": REMAT_MODES, "dtype": ("auto",) + tuple(DTYPES), "param_dtype": ("auto",) + tuple(DTYPES),
            "matmul_precision": PRECISIONS, "moe_gmm_impl": tuple(i for i in GMM_IMPLS if i != "capacity"),
            "attention_impl": ATTENTION_IMPLS, "grad_dtype": GRAD_DTYPES},
            ranges={"moe_capacity_factor": (">= 0 (0: dropless)", lambda v: v >= 0),
                    "moe_ep_capacity_factor": POSITIVE})
        if set(self.remat_names) - set(REMAT_NAMES):
            raise FieldError("remat_names", list(self.remat_names), f"; each must be one of {REMAT_NAMES}")
        if self.path and self.preset:
            raise ValueError("set at most one of model.path and model.preset")
        if self.path and not os.path.exists(self.path):
            if not hub.is_hub_id(self.path):
                raise FieldError("path", self.path, ": no such file or directory (a .gguf file, an HF model directory "
                                 "or a Hugging Face Hub id in the local cache)")
            try:
                hub.resolve(self.path)
            except FileNotFoundError as e:
                raise FieldError("path", self.path, f": {str(e).partition(': ')[2]}") from None
