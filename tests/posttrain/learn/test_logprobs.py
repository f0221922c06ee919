"""Token logprobs (log_softmax(logits / T) in float32, against NumPy) and the chunked ones with the hand-written
backward: equal to the naive full-logits path and to autodiff of the plain chunk loop, one weight-gradient buffer
instead of one per chunk, no full [B, T, V] logits, chunks without valid tokens skipped, and the requested matmul
precision on every dot."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.learn import logprobs
def _autodiff_reference(h_BxTxD, w_DxV, targets_BxT, temperature, chunk_size, with_entropy, valid_BxT):
    """A plain scan over chunks of C positions of every row, chunks without a valid token in any row skipped by
    `lax.cond`, differentiated by JAX."""
    b, t, d = h_BxTxD.shape
    c = min(chunk_size, t)
    k = -(-t // c)
    chunks = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, k * c - t)) + ((0, 0),) * (x.ndim - 2)).reshape(
        (b, k, c) + x.shape[2:]), 1, 0)
    h, tg = chunks(h_BxTxD), chunks(targets_BxT)
    valid = jnp.ones((b, t), bool) if valid_BxT is None else valid_BxT
    any_k = chunks(valid).any((1, 2))

    def one(w, h_c, t_c):
        lp, ent = logprobs.logp_and_entropy(jnp.einsum("bcd,dv->bcv", h_c, w) / temperature, t_c, True)
        return lp, ent

    def body(_, xs):
        h_c, t_c, a = xs
        zeros = jnp.zeros(t_c.shape, jnp.float32)
        return None, jax.lax.cond(a, one, lambda *_: (zeros, zeros), w_DxV, h_c, t_c)

    _, (lp, ent) = jax.lax.scan(body, None, (h, tg, any_k))
    un = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, k * c)[:, :t]
    return un(lp), un(ent)


@pytest.mark.parametrize("empty_chunks", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 8, 64])
def test_custom_backward_equals_autodiff_of_the_chunk_loop(empty_chunks, chunk_size):
    rng = np.random.default_rng(chunk_size)
    b, t, d, v = 2, 19, 16, 97  # 38 tokens: not a multiple of any chunk size above
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.5, jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    valid = None
    if empty_chunks:  # valid tokens first, then a long invalid tail: several whole chunks skipped
        valid = jnp.asarray(np.arange(b * t).reshape(b, t) < 7)
    wl = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
    we = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def new(h, w):
        out = logprobs.chunked_token_logprobs(h, w, tg, 0.7, chunk_size=chunk_size, with_entropy=True, valid_BxT=valid)
        return (out.logp_BxT * wl).sum() + (out.entropy_BxT * we).sum(), out

    def old(h, w):
        lp, ent = _autodiff_reference(h, w, tg, 0.7, chunk_size, True, valid)
        return (lp * wl).sum() + (ent * we).sum(), logprobs.LogprobsOut(lp, ent)

    (v_new, o_new), g_new = jax.jit(jax.value_and_grad(new, argnums=(0, 1), has_aux=True))(h, w)
    (v_old, o_old), g_old = jax.jit(jax.value_and_grad(old, argnums=(0, 1), has_aux=True))(h, w)
    np.testing.assert_allclose(o_new.logp_BxT, o_old.logp_BxT, atol=1e-6, rtol=0)
    np.testing.assert_allclose(o_new.entropy_BxT, o_old.entropy_BxT, atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(v_new), float(v_old), rtol=1e-6)
    for a, r in zip(g_new, g_old):  # float32 sums over 38 tokens in two orders: a few ulps (2.4e-6 at 0.92 seen)
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-6, rtol=5e-6)
    if empty_chunks:  # positions of every row past the chunk holding the 7 valid ones are skipped (zeros)
        lp = np.asarray(o_new.logp_BxT)
        first_skipped = -(-7 // min(chunk_size, t)) * min(chunk_size, t)
        assert np.all(lp[:, first_skipped:] == 0.0) and np.all(lp[:, :first_skipped] < 0)


def test_without_entropy_the_logp_gradient_matches():
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.normal(size=(1, 30, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 41)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, 41, (1, 30)), jnp.int32)
    f_new = lambda h, w: logprobs.chunked_token_logprobs(h, w, tg, 1.3, chunk_size=7).logp_BxT.sum()
    f_old = lambda h, w: _autodiff_reference(h, w, tg, 1.3, 7, False, None)[0].sum()
    for a, r in zip(jax.grad(f_new, (0, 1))(h, w), jax.grad(f_old, (0, 1))(h, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-6, rtol=1e-6)


def test_weight_gradient_is_one_buffer_not_one_per_chunk():
    """64 chunks of a [32, 4096] head: stacking per-chunk weight cotangents would need 64 x 0.5 MiB of temp."""
    n, d, v, c = 64 * 16, 32, 4096, 16
    h = jnp.zeros((1, n, d))
    w = jnp.zeros((d, v))
    tg = jnp.zeros((1, n), jnp.int32)
    valid = jnp.arange(n)[None] < n // 2

    def temp_bytes(f):
        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, w).compile().memory_analysis().temp_size_in_bytes

    new = lambda h, w: logprobs.chunked_token_logprobs(h, w, tg, chunk_size=c, valid_BxT=valid).logp_BxT.sum()
    old = lambda h, w: _autodiff_reference(h, w, tg, 1.0, c, True, valid)[0].sum()
    per_chunk_stack = (n // c) * d * v * 4
    assert temp_bytes(old) >= per_chunk_stack  # the measurement sees the stacked cotangents of the old form
    assert temp_bytes(new) < per_chunk_stack / 8


def test_precision_reaches_every_dot_of_forward_and_backward():
    h, w, tg = jnp.ones((1, 8, 4)), jnp.ones((4, 16)), jnp.zeros((1, 8), jnp.int32)
    f = lambda h, w: logprobs.chunked_token_logprobs(h, w, tg, chunk_size=4, precision="highest").logp_BxT.sum()
    hlo = jax.jit(jax.grad(f, (0, 1))).lower(h, w).as_text()
    n_dots = hlo.count("stablehlo.dot_general")
    assert n_dots >= 3 and hlo.count("HIGHEST") >= n_dots  # forward, d/dh and d/dw
    with pytest.raises(ValueError, match="precision"):
        logprobs.chunked_token_logprobs(h, w, tg, precision="tf32")

def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ----- the one definition of a token's logprob, chunked or not -----
def test_token_logprobs_matches_log_softmax_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    got = logprobs.token_logprobs(jnp.asarray(logits, jnp.bfloat16).astype(np.float32), targets, 0.7)
    want = np.take_along_axis(np_log_softmax(logits.astype(np.float64) / 0.7), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), want, atol=0.05)  # bf16 round trip of the logits
    got = logprobs.token_logprobs(logits, targets, 0.7)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    lsm = np_log_softmax(logits.astype(np.float64) / 0.7)
    want_ent = -(np.exp(lsm) * lsm).sum(-1)
    np.testing.assert_allclose(np.asarray(logprobs.token_entropy(logits, 0.7)), want_ent, rtol=1e-5, atol=1e-6)


def _chunk_vs_naive_inputs(b=2, t=7, d=16, v=300):
    k = jax.random.split(jax.random.key(1), 3)
    return (jax.random.normal(k[0], (b, t, d)), jax.random.normal(k[1], (d, v)) * 0.5,
            jax.random.randint(k[2], (b, t), 0, v))


@pytest.mark.parametrize("chunk_size", [1, 5, 100])
def test_chunked_matches_naive_values_and_gradients(chunk_size):
    h, w, tg = _chunk_vs_naive_inputs()
    wt = jax.random.normal(jax.random.key(2), tg.shape)  # weights so each token's gradient differs

    def naive(h, w):
        z = jnp.einsum("btd,dv->btv", h, w)
        return (logprobs.token_logprobs(z, tg, 0.8) * wt).sum() + (logprobs.token_entropy(z, 0.8) * wt**2).sum()

    def chunked(h, w):
        out = logprobs.chunked_token_logprobs(h, w, tg, 0.8, chunk_size=chunk_size, with_entropy=True)
        return (out.logp_BxT * wt).sum() + (out.entropy_BxT * wt**2).sum()

    (v_n, g_n), (v_c, g_c) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w) for f in (naive, chunked))
    np.testing.assert_allclose(float(v_c), float(v_n), rtol=1e-5)
    for a, b in zip(g_c, g_n):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    out = logprobs.chunked_token_logprobs(h, w, tg, 0.8, chunk_size=chunk_size)
    z = jnp.einsum("btd,dv->btv", h, w)
    want = np.asarray(logprobs.token_logprobs(z, tg, 0.8))
    np.testing.assert_allclose(np.asarray(out.logp_BxT), want, rtol=1e-5, atol=1e-6)
    assert out.entropy_BxT is None and out.logp_BxT.dtype == jnp.float32


def test_chunked_never_materialises_full_logits():
    b, t, d, v = 2, 512, 32, 8192
    h, w, tg = (jnp.zeros((b, t, d)), jnp.zeros((d, v)), jnp.zeros((b, t), jnp.int32))
    full_bytes = b * t * v * 4

    def temp_bytes(f):
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    naive = lambda h, w: logprobs.token_logprobs(jnp.einsum("btd,dv->btv", h, w), tg).sum()
    chunked = lambda h, w: logprobs.chunked_token_logprobs(h, w, tg, chunk_size=64, with_entropy=True).logp_BxT.sum()
    assert temp_bytes(naive) >= full_bytes  # the measurement can see a full [B, T, V] buffer
    assert temp_bytes(chunked) < full_bytes / 2


def test_chunked_logprobs_skip_chunks_without_valid_tokens():
    """Chunks holding no valid token are skipped; valid positions and gradients are unchanged."""
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(1, 40, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 50, (1, 40)), jnp.int32)
    valid = np.zeros((1, 40), bool)
    valid[0, [1, 5, 6, 17]] = True
    order, inverse = logprobs.valid_first_order(valid.reshape(-1))
    ordered = valid.reshape(-1)[np.asarray(order)]
    assert ordered[:4].all() and not ordered[4:].any()

    def f(w, skip):
        out = logprobs.chunked_token_logprobs(h[:, order], w, tgt[:, order], 0.7, chunk_size=4,
                                        valid_BxT=jnp.asarray(valid[:, order]) if skip else None)
        return out.logp_BxT[0][inverse]

    full, skipped = f(w, False), f(w, True)
    np.testing.assert_allclose(skipped[valid[0]], full[valid[0]], rtol=1e-6)
    assert np.all(np.asarray(skipped)[~valid[0]] == 0.0)
    g_full = jax.grad(lambda w: jnp.where(valid[0], f(w, False), 0.0).sum())(w)
    g_skip = jax.grad(lambda w: jnp.where(valid[0], f(w, True), 0.0).sum())(w)
    np.testing.assert_allclose(g_skip, g_full, rtol=1e-5, atol=1e-6)
