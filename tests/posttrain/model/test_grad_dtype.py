"""model.grad_dtype="compute": the scanned layers' matrices enter the layer scan in the compute dtype (their
gradients stacked in it), the router keeps float32, and loss and gradients match grad_dtype="param"."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_model

from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer, matrices_in_dtype


def test_compute_dtype_gradients_match_param_dtype_gradients(preset="tiny-moe"):  # routed experts + router
    toks = jnp.arange(16).reshape(2, 8) % 200
    results = {}
    for grad_dtype in ("param", "compute"):
        # the same host-drawn weights for both (no init compile), one jitted program each
        _, graphdef, state = random_model(preset, dtype="bfloat16", param_dtype="float32", grad_dtype=grad_dtype)

        def loss(st):
            logits, _ = nnx.merge(graphdef, st)(toks)
            return (logits * jnp.linspace(-1, 1, logits.shape[-1])).mean()

        results[grad_dtype] = jax.jit(jax.value_and_grad(loss))(state)
    (l0, g0), (l1, g1) = results["param"], results["compute"]
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert b.dtype == jnp.float32  # the optimizer still sees float32 gradients of float32 master weights
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-2 * float(jnp.abs(a).max()) + 1e-12)


def test_only_matrices_but_the_router_are_cast():
    cfg = get_preset("tiny-deepseek", dtype="bfloat16", param_dtype="float32")
    _, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    cast = matrices_in_dtype(state["moe_layers"], jnp.bfloat16)
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(cast)}
    router = [k for k in dtypes if "router" in k]
    assert router and all(dtypes[k] == jnp.float32 for k in router)
    for k in ("gate_proj", "down_proj", "q_a_proj", "o_proj"):
        assert any(k in p and d == jnp.bfloat16 for p, d in dtypes.items()), k
    assert all(d == jnp.float32 for p, d in dtypes.items() if "norm" in p or "score_bias" in p)
    same = matrices_in_dtype(state["moe_layers"], jnp.float32)  # nothing narrower: unchanged
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(same))


def test_unknown_grad_dtype_is_refused():
    with pytest.raises(ValueError, match="grad_dtype"):
        get_preset("tiny-qwen3", grad_dtype="bfloat16")
