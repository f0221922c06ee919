"""The generic step on a toy least-squares loss (no model): microbatch accumulation equals the full batch, min / max
metrics combine by min / max, a non-finite loss or gradient applies nothing, `loss_metric` gates on a metric."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.learn import step as step_lib
from posttrain.types import TrainState


def loss_fn(params, frozen, batch, ctx):
    """Sum of squared residuals over the microbatch, divided by the FULL batch's row count (ctx)."""
    r = batch["x"] @ params["w"] - batch["y"]
    share = (r ** 2).sum() / ctx
    return share, {"toy/loss": jax.lax.stop_gradient(share), "toy/r_max": jnp.abs(r).max(),
                   "toy/r_min": jnp.abs(r).min(), "toy/gated": batch["gate"].sum()}


def make(num_microbatches=1, loss_metric=""):
    tx = optax.sgd(0.1)
    params = {"w": jnp.asarray([0.5, -0.25, 1.0])}
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                       frozen={"base": None, "other": {}}, ref_params=None, rng=jax.random.key(0))
    settings = step_lib.StepSettings(num_microbatches=num_microbatches, loss_metric=loss_metric)
    fn = step_lib.make_step(loss_fn, tx, lambda s: 0.1, settings, context_fn=lambda st, b: b["x"].shape[0])
    return state, jax.jit(fn)


def batch(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(n, 3)), jnp.float32), "y": jnp.asarray(rng.normal(size=n), jnp.float32),
            "gate": jnp.zeros(n)}


def numpy_reference(w, x, y):
    r = x @ w - y
    return (r ** 2).sum() / len(y), 2 * x.T @ r / len(y)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_microbatches_give_the_full_batch_update_and_metrics(m):
    state, step = make(m)
    b = batch()
    w0 = np.asarray(state.params["w"])
    new, metrics = step(state, b)
    loss, grad = numpy_reference(w0.astype(np.float64), np.asarray(b["x"], np.float64), np.asarray(b["y"], np.float64))
    np.testing.assert_allclose(float(metrics["toy/loss"]), loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new.params["w"]), w0 - 0.1 * grad, rtol=1e-5, atol=1e-6)
    r = np.abs(np.asarray(b["x"]) @ w0 - np.asarray(b["y"]))
    np.testing.assert_allclose([float(metrics["toy/r_max"]), float(metrics["toy/r_min"])], [r.max(), r.min()],
                               rtol=1e-6)
    assert int(new.step) == 1 and float(metrics["policy/skipped_nonfinite"]) == 0.0


@pytest.mark.parametrize("where", ["x", "y"])
def test_a_non_finite_batch_applies_nothing_and_the_next_one_applies(where):
    state, step = make(2)
    bad = dict(batch())
    bad[where] = bad[where].at[3].set(jnp.nan)
    w0 = np.asarray(state.params["w"])
    new, m = step(state, bad)
    assert float(m["policy/skipped_nonfinite"]) == 1.0 and int(new.step) == 1
    np.testing.assert_array_equal(np.asarray(new.params["w"]), w0)
    newer, m = step(new, batch(1))
    assert float(m["policy/skipped_nonfinite"]) == 0.0 and not np.array_equal(np.asarray(newer.params["w"]), w0)


def test_loss_metric_gates_the_update_on_that_metric():
    state, step = make(1, loss_metric="toy/gated")
    b = dict(batch())
    b["gate"] = b["gate"].at[0].set(jnp.inf)  # finite loss and gradient, non-finite gated metric
    new, m = step(state, b)
    assert float(m["policy/skipped_nonfinite"]) == 1.0
    np.testing.assert_array_equal(np.asarray(new.params["w"]), np.asarray(state.params["w"]))
    _, m = make(1)[1](state, b)  # without loss_metric the same batch is applied
    assert float(m["policy/skipped_nonfinite"]) == 0.0


def test_rows_that_do_not_divide_are_one_error():
    state, step = make(3)
    with pytest.raises(ValueError, match="divisible by num_microbatches=3"):
        step(state, batch())
