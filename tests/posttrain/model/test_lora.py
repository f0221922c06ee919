"""LoRA adapters: applied on activations inside the projections; export folds them into the base weights."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import random_model

from posttrain.checkpoints.export import export_hf
from posttrain.checkpoints.load import load_hf_dir
from posttrain.model.config import LoRAConfig
from posttrain.model.layers import LoRAParam


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


def test_export_merges_trained_adapters_into_base_weights(tmp_path):
    """Random base weights (`helpers.random_model`: no eager init), adapters set to "trained" values; the forwards
    jitted (the exported model and the base alone share one program)."""
    for preset in ("tiny-qwen3", "tiny-deepseek"):
        cfg, graphdef, state = random_model(preset, lora=LoRAConfig(rank=4, alpha=8.0, targets=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
            "kv_a_proj")))
        model = nnx.merge(graphdef, state)
        adapters = nnx.state(model, LoRAParam)
        assert jax.tree.leaves(adapters)
        key = jax.random.key(1)
        nnx.update(model, jax.tree.map(lambda x: 0.05 * jax.random.normal(key, x.shape), adapters))  # "trained"
        tokens = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 9)))
        ours = _logits(graphdef, nnx.state(model), tokens)
        out = export_hf(cfg, nnx.state(model), tmp_path / preset)
        reloaded = load_hf_dir(out)
        assert reloaded.config.lora is None
        merged = _logits(reloaded.graphdef, reloaded.state, tokens)
        assert float(jnp.abs(ours - merged).max()) < 1e-4
        plain = nnx.merge(reloaded.graphdef, reloaded.state)
        nnx.update(plain, nnx.state(model, nnx.Not(LoRAParam)))
        base = _logits(reloaded.graphdef, nnx.state(plain), tokens)
        assert float(jnp.abs(base - ours).max()) > 1e-3  # the adapters did change the function


def test_lora_targets_name_exactly_the_projections_that_take_adapters():
    """config.LORA_TARGETS (what the config check accepts) is the set of projections add_adapters adapts across
    the architectures; a misspelled target is one error naming the allowed ones."""
    import dataclasses as dc

    import pytest
    from flax import nnx

    from posttrain.model.config import LORA_TARGETS, LoRAConfig
    from posttrain.model.presets import get_preset
    from posttrain.model.transformer import Transformer

    seen = set()
    for preset in ("tiny-dense", "tiny-deepseek"):
        cfg = get_preset(preset, lora=LoRAConfig(rank=2, targets=LORA_TARGETS))
        if cfg.mla is not None and not cfg.mla.q_lora_rank:
            cfg = dc.replace(cfg, mla=dc.replace(cfg.mla, q_lora_rank=16))  # the q_a / q_b projections too
        state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
            for part in path:
                name = str(getattr(part, "key", getattr(part, "name", "")))
                if name.endswith("_lora_a"):
                    seen.add(name.removesuffix("_lora_a"))
    assert seen == set(LORA_TARGETS)
    with pytest.raises(ValueError, match=r"\['q_prj'\] are not projection names; each must be one of"):
        LoRAConfig(rank=4, targets=("q_proj", "q_prj"))
