"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) over the stacked decoder parameters.

W_eff = W + (alpha / r) * A @ B for each targeted projection, with W viewed as a matrix [in, out]:
the einsum-shaped kernels are flattened as (leading `layers` axis kept) [L, in..., out...] -> [L, in, out].
A [L, in, r] is Gaussian, B [L, r, out] is zero, so at step 0 the adapted model *is* the base model; the
frozen base then doubles as the reference model for the KL term (no second copy of the weights).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

# number of leading "input" dims (after the layers axis) of each targeted kernel
IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1,
           "q_a_proj": 1, "q_b_proj": 1, "kv_a_proj": 1}


def _targets(params, targets):
    """[(path, Param)] of stacked kernels named in `targets`; routed-expert tensors [L, E, ...] are excluded."""
    out = []
    for path, v in nnx.to_flat_state(params):
        name = path[-1]
        routed_expert = path[0] == "moe_layers" and path[1:2] == ("ffn",) and len(path) == 3
        if name in targets and name in IN_DIMS and path[0].endswith("_layers") and not routed_expert:
            out.append((path, v))
    return out


def init_lora(params, *, rank: int, targets, key) -> nnx.State:
    """Adapter state {path + ('lora_a'|'lora_b'): Param}. Raises ValueError when no parameter matches."""
    found = _targets(params, tuple(targets))
    if not found:
        raise ValueError(f"LoRA targets {tuple(targets)} match no stacked projection; known: {sorted(IN_DIMS)}")
    leaves = []
    for i, (path, v) in enumerate(found):
        shape = v.shape
        k = IN_DIMS[path[-1]]
        d_in, d_out = math.prod(shape[1:1 + k]), math.prod(shape[1 + k:])
        a = jax.random.normal(jax.random.fold_in(key, i), (shape[0], d_in, rank), jnp.float32) * d_in ** -0.5
        leaves.append((path + ("lora_a",), nnx.Param(a, logical_axes=("layers", None, "lora_rank"))))
        leaves.append((path + ("lora_b",), nnx.Param(jnp.zeros((shape[0], rank, d_out), jnp.float32),
                                                     logical_axes=("layers", "lora_rank", None))))
    return nnx.from_flat_state(leaves)


def apply_lora(base, lora, *, rank: int, alpha: float):
    """Returns `base` with every adapted kernel replaced by W + (alpha / rank) * A @ B (differentiable in lora)."""
    scale = alpha / rank
    adapters = {}
    for path, v in nnx.to_flat_state(lora):
        adapters.setdefault(path[:-1], {})[path[-1]] = v.get_value()
    leaves = []
    for path, v in nnx.to_flat_state(base):
        w = v.get_value()
        if path in adapters:
            a, b = adapters[path]["lora_a"], adapters[path]["lora_b"]
            delta = jnp.einsum("lir,lro->lio", a, b).reshape(w.shape)
            w = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
        leaves.append((path, v.replace(w)))
    return nnx.from_flat_state(leaves)
