"""The train state of any algorithm: trainable params vs frozen state (LoRA or full), the reference copy, merging."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.infra import mesh as mesh_lib
from posttrain.model.layers import LoRAParam
from posttrain.model.transformer import Transformer
from posttrain.types import TrainState


def model_states(params, frozen) -> tuple:
    """The nnx states that `graphdef` merges, in split order: (adapters, base, rest) under LoRA, else (params, rest)."""
    return (params, frozen["base"], frozen["other"]) if frozen["base"] is not None else (params, frozen["other"])


def merge_model(graphdef, params, frozen):
    """The policy module from trainable params + frozen state."""
    return nnx.merge(graphdef, *model_states(params, frozen))


def reference_states(state: TrainState, need_reference: bool):
    """The frozen reference's nnx states (the initial policy) if `need_reference`, else None; ValueError if not kept."""
    if not need_reference:
        return None
    if state.ref_params is None:
        raise ValueError("a KL term needs a reference model: create the state with need_reference=True")
    return model_states(state.ref_params, state.frozen)


def create_train_state(graphdef, model_state, tx: optax.GradientTransformation, rng, *, lora_rank: int = 0,
                       need_reference: bool = False):
    """(graphdef for `merge_model`, TrainState): the model state split into trainable / frozen, optimizer initialised.

    Under `lora_rank` > 0 only the `LoRAParam` adapters train (ValueError without any), else all Params.
    `need_reference` keeps the initial trainable params as `ref_params` (the KL reference, design.md invariant 8)."""
    model = nnx.merge(graphdef, *(model_state if isinstance(model_state, tuple) else (model_state,)))
    ref = None
    if lora_rank:
        graphdef, trainable, base, other = nnx.split(model, LoRAParam, nnx.Param, ...)
        if not jax.tree.leaves(trainable):
            raise ValueError("lora.rank > 0 but the model has no adapters: build it with ModelConfig.lora")
        frozen = {"base": base, "other": other}
    else:
        graphdef, trainable, other = nnx.split(model, nnx.Param, ...)
        frozen = {"base": None, "other": other}
    if need_reference:
        ref = jax.tree.map(jnp.copy, trainable)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=trainable, opt_state=tx.init(trainable),
                       frozen=frozen, ref_params=ref, rng=rng)
    return graphdef, state


def abstract_train_state(model_cfg, tx, mesh, rules=mesh_lib.RULES, *, lora_rank: int = 0,
                         need_reference: bool = False):
    """(graphdef, abstract TrainState with shardings, its shardings) for `model_cfg` on `mesh` (nothing allocated)."""
    box = {}

    def init():
        graphdef, model_state = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(0)))
        box["graphdef"], state = create_train_state(graphdef, model_state, tx, jax.random.key(0),
                                                    lora_rank=lora_rank, need_reference=need_reference)
        return state

    with jax.set_mesh(mesh):
        state = jax.eval_shape(init)
        shardings = mesh_lib.state_shardings(state, mesh, rules)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    return box["graphdef"], abstract, shardings
