"""Hand-written pieces of the layers checked against references: the SwiGLU custom VJP against autodiff of the
plain formula (NumPy forward), in float32 and bfloat16; the GQA attention dots in both KV layouts against NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.model.layers import swiglu


def _reference(x, wg, wu, wd, dtype):
    g = jnp.matmul(x.astype(dtype), wg.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    u = jnp.matmul(x.astype(dtype), wu.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    return jnp.matmul((jax.nn.silu(g) * u).astype(dtype), wd.astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_value_and_gradients_match_autodiff(dtype, tol):
    rng = np.random.default_rng(0)
    N, D, F = 12, 16, 40
    x, wg, wu, wd = (jnp.asarray(rng.normal(size=s), jnp.float32) * sc
                     for s, sc in (((N, D), 1.0), ((D, F), 0.3), ((D, F), 0.3), ((F, D), 0.2)))
    cot = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    if dtype == jnp.float32:  # forward against NumPy
        g, u = np.asarray(x) @ np.asarray(wg), np.asarray(x) @ np.asarray(wu)
        want = (g / (1 + np.exp(-g)) * u) @ np.asarray(wd)
        np.testing.assert_allclose(np.asarray(swiglu(x, wg, wu, wd, dtype)), want, rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda *a: jnp.sum(f(*a, dtype).astype(jnp.float32) * cot)

    ours = jax.grad(loss(swiglu), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    ref = jax.grad(loss(_reference), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for name, a, b in zip(("x", "gate", "up", "down"), ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) / scale
        assert err <= tol, (name, err)


def test_gqa_dots_in_both_kv_layouts_match_numpy():
    """gqa_logits / gqa_combine give the NumPy GQA result (query head n reads kv head n // (N/K)) for entries in
    the attention's own [B, S, K, H] layout and in the KV-cache layout (`to_cache_layout`); cache_len finds S."""
    from posttrain.model.attention import cache_len, gqa_combine, gqa_logits, to_cache_layout

    rng = np.random.default_rng(0)
    B, T, N, K, S, H = 2, 3, 6, 2, 5, 4
    q, p = rng.normal(size=(B, T, N, H)), rng.random((B, T, N, S))
    kv = {"k": rng.normal(size=(B, S, K, H)), "v": rng.normal(size=(B, S, K, H))}
    kv_of_head = np.arange(N) // (N // K)
    ref_logits = np.einsum("btnh,bsnh->btns", q, kv["k"][:, :, kv_of_head])
    ref_out = np.einsum("btns,bsnh->btnh", p, kv["v"][:, :, kv_of_head])
    cached = to_cache_layout({k: jnp.asarray(v, jnp.float32) for k, v in kv.items()})
    assert sorted(cached) == ["k_bkhs", "v_bksh"] and cache_len(cached) == S
    for entries in ({k: jnp.asarray(v, jnp.float32) for k, v in kv.items()}, cached):
        np.testing.assert_allclose(gqa_logits(jnp.asarray(q, jnp.float32), entries), ref_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gqa_combine(jnp.asarray(p, jnp.float32), entries), ref_out, rtol=1e-5, atol=1e-5)
