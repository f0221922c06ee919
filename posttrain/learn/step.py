"""The generic train step: `make_step(loss_fn, tx, lr_schedule, settings) -> step(state, batch) -> (state, metrics)`.

Loss protocol, accumulation and non-finite skip: docs/learner.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.infra.partitioning import with_logical_constraint
from posttrain.types import TrainState

LossFn = Callable[[Any, Any, Any, Any], tuple[jax.Array, dict]]


class StepSettings(NamedTuple):
    """Static settings of the generic step (hashable).

    M = num_microbatches >= 1; bias_update_rate: aux-loss-free MoE routing-bias rate (0: none); loss_metric: the
    metric whose finiteness gates an update with the gradient norm's ("": the loss itself)."""

    num_microbatches: int = 1
    bias_update_rate: float = 0.0
    loss_metric: str = ""


def combine(key: str):
    """How metric `key` combines across microbatches: min for `*_min`, max for `*_max`, else a sum of shares."""
    return jnp.minimum if key.endswith("_min") else jnp.maximum if key.endswith("_max") else jnp.add


def split_microbatches(x, m: int):
    """[R, ...] -> [m, R / m, ...], the microbatch dimension unsharded and rows kept on the batch axes."""
    y = x.reshape((m, x.shape[0] // m) + x.shape[1:])
    return with_logical_constraint(y, (None, "batch") + (None,) * (x.ndim - 1))


def accumulate_gradients(loss_fn: LossFn, params, frozen, batch, context, num_microbatches: int):
    """(loss, grads, metrics) summed over microbatches (`combine`); ValueError when rows do not split into them."""
    M = num_microbatches
    bad = {x.shape[0] for x in jax.tree.leaves(batch) if x.shape[0] % M}
    if bad:
        raise ValueError(f"leading dimensions {sorted(bad)} of the batch must be divisible by num_microbatches={M}")
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(mb):
        (loss, m), g = grad_fn(params, frozen, mb, context)
        return loss, g, m

    if M == 1:
        return one(batch)

    def body(carry, mb):
        loss, g, m = one(mb)
        total, grads, metrics = carry
        return (total + loss, jax.tree.map(jnp.add, grads, g),
                {k: combine(k)(metrics[k], m[k]) for k in metrics}), None

    mbs = jax.tree.map(lambda x: split_microbatches(x, M), batch)
    loss_sd, _, m_sd = jax.eval_shape(lambda: one(jax.tree.map(lambda x: x[0], mbs)))
    fill = lambda k: jnp.inf if k.endswith("_min") else -jnp.inf if k.endswith("_max") else 0.0
    zeros_m = {k: jnp.full(sd.shape, fill(k), sd.dtype) for k, sd in m_sd.items()}
    init = (jnp.zeros(loss_sd.shape, loss_sd.dtype), jax.tree.map(jnp.zeros_like, params), zeros_m)
    (loss, grads, metrics), _ = jax.lax.scan(body, init, mbs)
    return loss, grads, metrics


def update_routing_bias(frozen, load_LxE, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): bias += rate * sign(mean load - load), per layer."""
    leaves = []
    for path, v in nnx.to_flat_state(frozen["other"]):
        if path[-1] == "score_bias":
            load = load_LxE[-v.shape[0]:]
            v = v.replace(v.get_value() + rate * jnp.sign(load.mean(-1, keepdims=True) - load))
        leaves.append((path, v))
    return {**frozen, "other": nnx.from_flat_state(leaves)}


def skip_by_cond(finite, applied, params, opt_state, frozen, grads):
    """`applied(params, opt_state, frozen, grads)` if `finite`, else the old values, by `lax.cond` (the CPU form)."""
    return jax.lax.cond(finite, applied, lambda p, o, f, g: (p, o, f), params, opt_state, frozen, grads)


def skip_by_select(finite, applied, params, opt_state, frozen, grads):
    """`skip_by_cond` by an element-wise select (the GPU and TPU form: a cond there needs more temp memory)."""
    new = applied(params, opt_state, frozen, grads)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (params, opt_state, frozen))


def apply_update(state: TrainState, loss, grads, metrics: dict, tx: optax.GradientTransformation, lr_schedule,
                 settings: StepSettings):
    """One optimizer and routing-bias update; returns (state, metrics + optim/*, moe/*, policy/skipped_nonfinite).

    A non-finite loss or gradient norm is never applied: the state keeps its values, its step counter advances."""
    grad_norm = optax.global_norm(grads)
    gate = metrics[settings.loss_metric] if settings.loss_metric else loss
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(gate)
    metrics = dict(metrics)
    load = metrics.pop("moe/expert_load", None)
    if load is not None:
        metrics["moe/expert_load_max"] = load.max()
        metrics["moe/expert_load_min"] = load.min()

    def applied(params, opt_state, frozen, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        if load is not None and settings.bias_update_rate:
            frozen = update_routing_bias(frozen, load, settings.bias_update_rate)
        return optax.apply_updates(params, updates), opt_state, frozen

    by_cond, by_select = (functools.partial(form, finite, applied) for form in (skip_by_cond, skip_by_select))
    params, opt_state, frozen = jax.lax.platform_dependent(state.params, state.opt_state, state.frozen, grads,
                                                           cpu=by_cond, default=by_select)
    metrics["optim/grad_norm"] = grad_norm
    metrics["optim/lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    metrics["policy/skipped_nonfinite"] = (~finite).astype(jnp.float32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, frozen=frozen), metrics


def update(loss_fn: LossFn, state: TrainState, batch, context, tx, lr_schedule, settings: StepSettings):
    """One optimizer update on `batch`: `accumulate_gradients`, then `apply_update`."""
    loss, grads, metrics = accumulate_gradients(loss_fn, state.params, state.frozen, batch, context,
                                                settings.num_microbatches)
    return apply_update(state, loss, grads, metrics, tx, lr_schedule, settings)


def make_step(loss_fn: LossFn, tx: optax.GradientTransformation, lr_schedule, settings: StepSettings, *,
              context_fn: Callable[[TrainState, Any], Any] | None = None):
    """The pure step `(state, batch) -> (state, metrics)`; `context_fn(state, batch)` goes to each microbatch's loss."""

    def step(state: TrainState, batch):
        context = None if context_fn is None else context_fn(state, batch)
        return update(loss_fn, state, batch, context, tx, lr_schedule, settings)

    return step


def reduce_updates(key: str, values_U):
    """One step metric from its values over U updates: min / max for `*_min` / `*_max`, the last lr, else the mean."""
    if key.endswith("_min"):
        return values_U.min()
    if key.endswith("_max"):
        return values_U.max()
    return values_U[-1] if key == "optim/lr" else values_U.mean()


def jit_step(step_fn, state_shardings=None, batch_shardings=None):
    """`jax.jit` with the state donated and, when given, the state's and batch's shardings (metrics unconstrained)."""
    if state_shardings is None:
        return jax.jit(step_fn, donate_argnums=(0,))
    return jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, None), donate_argnums=(0,))
