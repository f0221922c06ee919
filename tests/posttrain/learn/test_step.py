"""The generic step on a toy least-squares loss (no model): microbatch accumulation equals the full batch, min / max
metrics combine by min / max, a non-finite loss or gradient applies nothing, `loss_metric` gates on a metric, the
CPU's cond skip and the GPU's select skip agree."""
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


@pytest.mark.parametrize("finite", [True, False])
def test_the_cond_and_select_skips_agree(finite):
    tx = optax.adam(0.1)
    params = {"w": jnp.asarray([0.5, -0.25, 1.0])}
    opt_state, frozen, grads = tx.init(params), {"other": {"b": jnp.ones(2)}}, {"w": jnp.asarray([1.0, 2.0, -3.0])}

    def applied(p, o, f, g):
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, {"other": {"b": f["other"]["b"] + 1}}

    args = (jnp.asarray(finite), applied, params, opt_state, frozen, grads)
    by_cond, by_select = step_lib.skip_by_cond(*args), step_lib.skip_by_select(*args)
    jax.tree.map(np.testing.assert_array_equal, by_cond, by_select)
    unchanged = jax.tree.map(np.array_equal, by_cond, (params, opt_state, frozen))
    assert all(jax.tree.leaves(unchanged)) != finite


def test_the_step_skips_by_cond_on_the_cpu_and_by_select_on_gpu():
    state, step = make(1)
    lowered = {p: step.trace(state, batch()).lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
    # platform_dependent is itself a case on a constant index (XLA folds it); the CPU's skip is one case more.
    assert lowered["cpu"].count("stablehlo.case") == lowered["cuda"].count("stablehlo.case") + 1
    assert "stablehlo.select" not in lowered["cpu"] and "stablehlo.select" in lowered["cuda"]
