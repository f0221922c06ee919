"""`posttrain.model.gmm.grouped_matmul`: every implementation equals a NumPy reference in values and gradients
(x and w) for a table of group layouts, and the capacity path of `moe.expert_ffn` drops exactly the rows over
capacity (counted by `moe.expert_keys`)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from posttrain.model import gmm, moe

pytestmark = pytest.mark.kernel  # scripts/accelerator_check.sh runs these on the accelerator

M, D, F = 40, 12, 20
LAYOUTS = {  # group sizes (E = len); sum <= M, rows past the sum give 0 and get no gradient
    "uneven": [7, 0, 20, 3, 6],
    "all_in_one": [0, 0, 40, 0],
    "full": [10, 10, 10, 10],
    "empty_tail": [1, 2, 0, 0, 0, 0, 0, 1],
    "nothing": [0, 0, 0],
}


def numpy_reference(x, w, sizes, ct):
    """y = x[r] @ w[g(r)]; dx = ct @ w[g]^T; dw[e] = x_e^T ct_e (float64)."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    y, dx, dw = np.zeros((len(x), w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[e]
        dx[rows] = ct[rows] @ w[e].T
        dw[e] = x[rows].T @ ct[rows]
        start += n
    return y, dx, dw


def _inputs(sizes, seed=0):
    rng = np.random.default_rng(seed)
    E = len(sizes)
    return (rng.normal(size=(M, D)).astype(np.float32), rng.normal(size=(E, D, F)).astype(np.float32),
            np.asarray(sizes, np.int32), rng.normal(size=(M, F)).astype(np.float32))


def _check(impl, sizes, **kw):
    x, w, s, ct = _inputs(sizes)
    y_ref, dx_ref, dw_ref = numpy_reference(x, w, sizes, ct)

    def f(x, w):
        return gmm.grouped_matmul(x, w, jnp.asarray(s), impl=impl, precision="highest", **kw)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(ct))
    tol = dict(rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(y), y_ref, **tol)
    np.testing.assert_allclose(np.asarray(dx), dx_ref, **tol)
    np.testing.assert_allclose(np.asarray(dw), dw_ref, **tol)
    assert y.dtype == jnp.float32 and y.shape == (M, F)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl,kw", [("ragged", {}), ("padded", {"block": 1}), ("padded", {"block": 4}),
                                     ("padded", {}), ("capacity", {"capacity": 40})])
def test_grouped_matmul_equals_numpy(impl, kw, layout):
    _check(impl, LAYOUTS[layout], **kw)


@pytest.mark.parametrize("layout", ["uneven", "full"])
def test_megablox_interpret_equals_numpy(layout):
    # the TPU kernel under interpret=True (seconds per call on CPU): rows past the groups are masked (the kernel
    # leaves them uninitialised; NaN in interpret mode) in the output and in the input gradient
    _check("megablox", LAYOUTS[layout])


def test_capacity_keeps_the_first_rows_of_each_group():
    # capacity 6 < group size 20: rows 6..19 of the group are lost (the caller must drop and count them first)
    sizes = [7, 0, 20, 3, 6]
    x, w, s, _ = _inputs(sizes)
    y = np.asarray(gmm.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), impl="capacity", capacity=7,
                                      precision="highest"))
    y_ref = numpy_reference(x, w, sizes, np.zeros((M, F)))[0]
    lost = np.zeros(M, bool)
    lost[7 + 7: 7 + 20] = True
    np.testing.assert_allclose(y[~lost], y_ref[~lost], rtol=1e-5, atol=1e-4)
    assert np.all(y[lost] == 0)


def test_bad_arguments_raise():
    x, w, s = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        gmm.grouped_matmul(x, w, s, impl="nope")
    with pytest.raises(ValueError, match="capacity"):
        gmm.grouped_matmul(x, w, s, impl="capacity")
    with pytest.raises(ValueError, match="do not match"):
        gmm.grouped_matmul(x, jnp.zeros((2, 5, 3)), s)


@pytest.mark.parametrize("platform,impl", [("tpu", "megablox"), ("gpu", "padded"), ("cpu", "padded")])
def test_auto_impl_per_backend(platform, impl):
    assert gmm.auto_impl(platform) == impl


@pytest.mark.parametrize("rows,groups,block", [(131072, 128, 1024), (8192, 128, 64), (64, 8, 8), (40, 5, 8), (10 ** 7, 8, 1024)])
def test_default_block(rows, groups, block):
    assert gmm.default_block(rows, groups) == block


def _ffn_inputs(M, E, k, seed=1, skew=0.0):
    rng = np.random.default_rng(seed)
    Dm, Fm = 8, 6
    logits = rng.normal(size=(M, E)) + skew * (np.arange(E) == 0)
    experts = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(M, k)).astype(np.float32)
    ws = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, Dm, Fm), (E, Dm, Fm), (E, Fm, Dm))]
    return rng.normal(size=(M, Dm)).astype(np.float32), experts, weights, ws


def _numpy_ffn(x, experts, weights, ws, keep):
    wg, wu, wd = (np.asarray(a, np.float64) for a in ws)
    y = np.zeros(x.shape)
    for m in range(len(x)):
        for j, e in enumerate(experts[m]):
            if keep[m, j]:
                g, u = x[m] @ wg[e], x[m] @ wu[e]
                y[m] += weights[m, j] * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return y


@pytest.mark.parametrize("impl", ["ragged", "padded"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
def test_expert_ffn_capacity_drops_and_counts_exactly(impl, capacity_factor):
    M, E, k = 24, 4, 2
    x, experts, weights, ws = _ffn_inputs(M, E, k, skew=3.0)  # expert 0 is over-subscribed
    keep = np.ones((M, k), bool)
    if capacity_factor is not None:  # NumPy: each expert keeps its first C assignments in token-major order
        C = int(np.ceil(capacity_factor * M * k / E))
        seen = np.zeros(E, int)
        for m in range(M):
            for j in range(k):
                keep[m, j] = seen[experts[m, j]] < C
                seen[experts[m, j]] += 1
    with jax.default_matmul_precision("highest"):
        y = moe.expert_ffn(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), *map(jnp.asarray, ws),
                           jnp.float32, impl=impl, capacity_factor=capacity_factor)
    np.testing.assert_allclose(np.asarray(y), _numpy_ffn(x, experts, weights, ws, keep), rtol=1e-5, atol=1e-5)
    C = None if capacity_factor is None else moe.expert_capacity(M * k, E, capacity_factor)
    _, dropped = moe.expert_keys(jnp.asarray(experts), E, 0, C)
    assert int(dropped) == int((~keep).sum())
    assert (int(dropped) > 0) == (capacity_factor is not None)  # skewed: capacity drops something
