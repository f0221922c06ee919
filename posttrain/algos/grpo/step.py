"""The jitted GRPO update: `train_step(state, batch) -> (state, metrics)`.

Dimension legend: see `posttrain.types` (R rows, L width, N samples, C scored slots, M microbatches, D d_model).

Per microbatch: decoder hidden states over the rows -> gather the hidden states that predict each scored slot ->
chunked logprobs `log_softmax(h @ W / T)` at the targets (never materialising [N, C, V] logits) -> `policy_loss`
with the FULL batch's denominators, so summing microbatch losses and gradients gives exactly the full-batch
value (invariant 3). Microbatches run under `lax.scan`; then one optax update. The state is donated.

Policy ratio (invariant 1): with one update per batch the ratio's denominator is the trainer's own logprob
(stop-gradient), so the ratio is exactly 1 in any dtype. With `ppo_epochs` x `minibatches` updates per batch
(PPO-style reuse, as verl's ppo_epochs / ppo_mini_batch_size and TRL's num_iterations), the trainer first
computes every slot's logprob under the behaviour (pre-update) weights, once; the first update still uses its
own logprob (exactly 1), later updates use those old logprobs. Minibatches are contiguous row blocks, visited in
order each epoch. The sampler's logprobs serve only truncated importance sampling and the logp_diff metrics.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.algos.grpo import losses as losses_lib
from posttrain.infra import mesh as mesh_lib
from posttrain.model.layers import LoRAParam
from posttrain.infra.partitioning import active_mesh, current_rules, with_logical_constraint
from posttrain.types import RolloutBatch, TrainState


class StepOptions(NamedTuple):
    """Static settings of the step (hashable)."""

    loss: losses_lib.LossConfig
    temperature: float
    num_microbatches: int = 1
    moe_aux_coef: float = 0.0
    moe_z_coef: float = 0.0
    bias_update_rate: float = 0.0
    lora_rank: int = 0
    logprob_chunk: int = 256
    ppo_epochs: int = 1
    minibatches: int = 1
    matmul_precision: str = "default"  # of the logprob matmuls (the model's own dots follow its config)

    @property
    def updates_per_batch(self) -> int:
        return self.ppo_epochs * self.minibatches


def model_states(params, frozen) -> tuple:
    """The nnx states that `graphdef` merges, in split order: (adapters, base, rest) under LoRA, else (params, rest)."""
    return (params, frozen["base"], frozen["other"]) if frozen["base"] is not None else (params, frozen["other"])


def merge_model(graphdef, params, frozen):
    """The policy module from trainable params + frozen state."""
    return nnx.merge(graphdef, *model_states(params, frozen))


def score_logprobs(model, batch: RolloutBatch, temperature: float, chunk: int, with_entropy: bool = False,
                   precision: str = "default"):
    """Trainer logprobs (and entropy) of every scored slot: float32 [N, C] (0 on masked slots); plus aux.

    Only slots with a policy token are pushed through the unembedding: slots are reordered valid-first and
    chunks holding none are skipped, so the vocabulary-wide matmuls scale with real tokens, not with N * C.
    The reordering stays within each batch shard of the active mesh (rows and their samples are split over the
    same devices), so no device gathers another's hidden states: a global order made XLA all-reduce the whole
    [N * C, D] selection on every device (12 GiB per device in a DeepSeek-V3 plan on 256 H200s).
    """
    replay = batch.routed_experts_RxLxLmxk  # routing replay: the sampler's expert selections, or None
    h, aux = model.hidden_states(batch.tokens_RxL, batch.positions_RxL, batch.segment_ids_RxL,
                                 batch.branch_ids_RxL,
                                 replay_experts_LxBxTxk=None if replay is None else replay.transpose(2, 0, 1, 3))
    R, L, D = h.shape
    N, C = batch.targets_NxC.shape
    P = _local_shards(R)  # P batch shards, each with R/P rows and their N/P samples
    rows = jnp.repeat(jnp.arange(R // P, dtype=jnp.int32), N // R)
    flat = jnp.tile(rows, P).reshape(P, N // P, 1) * L + batch.score_pos_NxC.reshape(P, N // P, C)
    flat = flat.reshape(P, -1)  # [P, N/P * C] positions within the shard's rows
    valid = (batch.loss_mask_NxC & batch.valid_N[:, None]).reshape(P, -1)
    order, inverse = jax.vmap(losses_lib.valid_first_order)(valid)
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    h_sel = take(h.reshape(P, R // P * L, D), take(flat, order))
    h_sel = with_logical_constraint(h_sel, ("batch", None, None))
    out = losses_lib.chunked_token_logprobs(h_sel, model.unembedding(), take(batch.targets_NxC.reshape(P, -1), order),
                                            temperature, chunk_size=chunk, with_entropy=with_entropy,
                                            valid_BxT=take(valid, order), precision=precision)
    unsort = lambda x: None if x is None else take(x, inverse).reshape(N, C)
    return losses_lib.LogprobsOut(unsort(out.logp_BxT), unsort(out.entropy_BxT)), aux


def _local_shards(rows: int) -> int:
    """Batch shards of the active mesh (1 without one, or when `rows` does not divide over them)."""
    mesh = active_mesh()
    if mesh is None:
        return 1
    n = mesh_lib.batch_shards(mesh.shape, current_rules())
    return n if rows % n == 0 else 1


def _scores(model, mb: RolloutBatch, opts: StepOptions, with_entropy: bool = False):
    return score_logprobs(model, mb, opts.temperature, opts.logprob_chunk, with_entropy, opts.matmul_precision)


def _microbatch_loss(params, frozen, ref_model_state, mb: RolloutBatch, den, graphdef, opts: StepOptions,
                     own_old=True):
    model = merge_model(graphdef, params, frozen)
    out, aux = _scores(model, mb, opts, with_entropy=True)
    logp_ref = None
    if ref_model_state is not None:
        ref = nnx.merge(graphdef, *ref_model_state)
        logp_ref = jax.lax.stop_gradient(_scores(ref, mb, opts)[0].logp_BxT)
    mask = mb.loss_mask_NxC & mb.valid_N[:, None]
    own = jax.lax.stop_gradient(out.logp_BxT)
    old = own if mb.logp_old_NxC is None else jnp.where(own_old, own, mb.logp_old_NxC)
    loss, metrics = losses_lib.policy_loss(out.logp_BxT, mb.logp_sample_NxC, mb.advantages_N, mask, den, opts.loss,
                                           logp_old_BxT=old, logp_ref_BxT=logp_ref, entropy_BxT=out.entropy_BxT)
    diff = jnp.where(mask, jnp.abs(old - mb.logp_sample_NxC), 0.0)  # behaviour policy: trainer vs sampler
    metrics["rollout/logp_diff_mean"] = diff.sum() / jnp.maximum(den.num_tokens, 1.0)
    metrics["rollout/logp_diff_max"] = diff.max()
    if "load_balance_loss" in aux:
        share = 1.0 / opts.num_microbatches
        loss = loss + share * (opts.moe_aux_coef * aux["load_balance_loss"] + opts.moe_z_coef * aux["router_z_loss"])
        metrics["moe/load_balance_loss"] = share * aux["load_balance_loss"]
        metrics["moe/router_z_loss"] = share * aux["router_z_loss"]
        metrics["moe/expert_load"] = share * aux["expert_load"]
        if "ep_dropped_frac" in aux:
            metrics["moe/ep_dropped_frac"] = share * aux["ep_dropped_frac"]
    return loss, metrics


def _split(x, m):
    y = x.reshape((m, x.shape[0] // m) + x.shape[1:])
    return with_logical_constraint(y, (None, "batch") + (None,) * (x.ndim - 1))


def _combine(key):
    """How metric `key` combines across microbatches (and updates): sum of shares, or min / max."""
    return jnp.minimum if key in losses_lib.MIN_METRICS else jnp.maximum if key in losses_lib.MAX_METRICS else jnp.add


def reference_state(state: TrainState, opts: StepOptions):
    """The nnx states of the frozen reference model (the initial policy, exactly) when the loss needs one
    (beta > 0), else None. Under LoRA the reference is the frozen base plus the INITIAL adapters (non-zero when
    training starts from an SFT adapter), kept in `ref_params`; without LoRA, a copy of the initial Params."""
    if opts.loss.beta <= 0:
        return None
    if state.ref_params is None:
        raise ValueError("rl.beta > 0 needs a reference model: create the state with need_reference=True")
    return model_states(state.ref_params, state.frozen)


def accumulate_gradients(graphdef, state: TrainState, batch: RolloutBatch, opts: StepOptions, own_old=True):
    """Sum over microbatches (lax.scan) of the gradients and metric shares of `_microbatch_loss`.

    Returns (grads like state.params, metrics dict). Because every microbatch is normalised by the FULL batch's
    denominators, the result equals the unsplit batch's gradient (invariant 3). own_old (bool, may be traced):
    the ratio's denominator is the trainer's own logprob even when `batch.logp_old_NxC` is set.
    Raises ValueError when rows or samples do not divide into `opts.num_microbatches`.
    """
    M = opts.num_microbatches
    R, N = batch.tokens_RxL.shape[0], batch.targets_NxC.shape[0]
    if R % M or N % M:
        raise ValueError(f"rows {R} and samples {N} must be divisible by num_microbatches={M}")
    den = losses_lib.loss_denominators(batch.loss_mask_NxC & batch.valid_N[:, None])
    ref_state = reference_state(state, opts)
    grad_fn = jax.value_and_grad(_microbatch_loss, has_aux=True)

    def one(mb):
        (_, m), g = grad_fn(state.params, state.frozen, ref_state, mb, den, graphdef, opts, own_old)
        return g, m

    if M == 1:
        return one(batch)

    def body(carry, mb):
        g, m = one(mb)
        grads, metrics = carry
        grads = jax.tree.map(jnp.add, grads, g)
        metrics = {k: _combine(k)(metrics[k], m[k]) for k in metrics}
        return (grads, metrics), None

    mbs = jax.tree.map(lambda x: _split(x, M), batch)
    m_shape = jax.eval_shape(lambda: one(jax.tree.map(lambda x: x[0], mbs))[1])
    init = {losses_lib.MIN_METRICS: jnp.inf, losses_lib.MAX_METRICS: -jnp.inf}
    zeros_m = {k: jnp.full(sd.shape, next((v for ks, v in init.items() if k in ks), 0.0), sd.dtype)
               for k, sd in m_shape.items()}
    zeros_g = jax.tree.map(jnp.zeros_like, state.params)
    (grads, metrics), _ = jax.lax.scan(body, (zeros_g, zeros_m), mbs)
    return grads, metrics


def apply_update(state: TrainState, grads, metrics: dict, tx: optax.GradientTransformation, lr_schedule,
                 opts: StepOptions):
    """One optimizer update (+ the aux-free routing-bias update); returns (state, metrics with optim/*, moe/*).

    A non-finite loss or gradient norm is never applied: parameters, optimizer state and routing biases stay as
    they were, the step counter still advances, and `policy/skipped_nonfinite` is 1 (the loop logs it and stops
    after `train.max_nonfinite_skips` consecutive skips)."""
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["policy/loss"])
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    frozen = state.frozen
    metrics = dict(metrics)
    if "moe/expert_load" in metrics:
        load = metrics.pop("moe/expert_load")
        metrics["moe/expert_load_max"] = load.max()
        metrics["moe/expert_load_min"] = load.min()
        if opts.bias_update_rate:
            frozen = update_routing_bias(frozen, load, opts.bias_update_rate)
    metrics["optim/grad_norm"] = grad_norm
    metrics["optim/lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    metrics["policy/skipped_nonfinite"] = (~finite).astype(jnp.float32)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    return state.replace(step=state.step + 1, params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state), frozen=keep(frozen, state.frozen)), metrics


def behaviour_logprobs(graphdef, state: TrainState, batch: RolloutBatch, opts: StepOptions):
    """float32 [N, C] trainer logprobs of every scored slot under the current weights (no gradient), computed
    `minibatches * num_microbatches` rows at a time (the training step's memory bound)."""
    model = merge_model(graphdef, state.params, state.frozen)
    parts = opts.minibatches * opts.num_microbatches
    mbs = jax.tree.map(lambda x: _split(x, parts), batch)
    logp = jax.lax.map(lambda mb: _scores(model, mb, opts)[0].logp_BxT, mbs)
    return jax.lax.stop_gradient(logp.reshape(batch.targets_NxC.shape))


def ppo_updates(graphdef, state: TrainState, batch: RolloutBatch, tx: optax.GradientTransformation, lr_schedule,
                opts: StepOptions):
    """`opts.ppo_epochs` passes over `opts.minibatches` contiguous row blocks of the batch, one optimizer update per
    block (lax.scan). Returns (state, metrics stacked per update: {name: [U]}), U = ppo_epochs * minibatches.

    Raises ValueError when rows or samples do not divide into minibatches x microbatches.
    """
    B, U = opts.minibatches, opts.updates_per_batch
    R, N = batch.tokens_RxL.shape[0], batch.targets_NxC.shape[0]
    if R % (B * opts.num_microbatches) or N % (B * opts.num_microbatches):
        raise ValueError(f"rows {R} and samples {N} must be divisible by minibatches x num_microbatches = "
                         f"{B} x {opts.num_microbatches}")
    batch = batch.replace(logp_old_NxC=behaviour_logprobs(graphdef, state, batch, opts))
    blocks = jax.tree.map(lambda x: _split(x, B), batch)

    def body(st, u):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, u % B, keepdims=False), blocks)
        grads, metrics = accumulate_gradients(graphdef, st, mb, opts, own_old=u == 0)
        return apply_update(st, grads, metrics, tx, lr_schedule, opts)

    return jax.lax.scan(body, state, jnp.arange(U))


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_schedule, opts: StepOptions):
    """Returns the pure step function `(state, batch) -> (state, metrics)` (jit it with `jit_train_step`).

    With several updates per batch the metrics are means over the updates (min / max for the min / max metrics)
    and `optim/lr` is the last update's."""

    def step(state: TrainState, batch: RolloutBatch):
        if opts.updates_per_batch == 1:
            grads, metrics = accumulate_gradients(graphdef, state, batch, opts)
            state, metrics = apply_update(state, grads, metrics, tx, lr_schedule, opts)
        else:
            state, per_update = ppo_updates(graphdef, state, batch, tx, lr_schedule, opts)
            metrics = {k: reduce_updates(k, v) for k, v in per_update.items()}
        for k in losses_lib.MIN_METRICS + losses_lib.MAX_METRICS:  # +-inf: no policy token in the batch (NaN stays)
            if k in metrics:
                metrics[k] = jnp.where(jnp.isinf(metrics[k]), 1.0 if "ratio" in k else 0.0, metrics[k])
        return state, metrics

    return step


def reduce_updates(key: str, values_U):
    """One step metric from its per-update values [U]."""
    if key in losses_lib.MIN_METRICS or key.endswith("_min"):
        return values_U.min()
    if key in losses_lib.MAX_METRICS or key.endswith("_max"):
        return values_U.max()
    return values_U[-1] if key == "optim/lr" else values_U.mean()


def update_routing_bias(frozen, load_LxE, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): bias += rate * sign(mean load - load), per layer."""
    leaves = []
    for path, v in nnx.to_flat_state(frozen["other"]):
        if path[-1] == "score_bias":
            load = load_LxE[-v.shape[0]:]
            v = v.replace(v.get_value() + rate * jnp.sign(load.mean(-1, keepdims=True) - load))
        leaves.append((path, v))
    return {**frozen, "other": nnx.from_flat_state(leaves)}


def jit_train_step(step_fn, state_shardings=None, batch_shardings=None):
    """jit with explicit in/out shardings (when given) and the state donated."""
    if state_shardings is None:
        return jax.jit(step_fn, donate_argnums=(0,))
    return jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, None), donate_argnums=(0,))


def create_train_state(graphdef, model_state, tx: optax.GradientTransformation, rng, opts: StepOptions, *,
                       need_reference: bool = False):
    """Splits a model state into trainable params / frozen state and initialises the optimizer.

    With `opts.lora_rank`, the trainable params are the model's `LoRAParam` adapters and every base `nnx.Param` is
    frozen; otherwise all Params train. When `need_reference`, a copy of the initial trainable params (the
    adapters under LoRA: small) is kept as `ref_params`, so the reference is the initial policy exactly.
    Returns (graphdef for `merge_model`, TrainState). Raises ValueError for LoRA on a model without adapters.
    """
    model = nnx.merge(graphdef, *(model_state if isinstance(model_state, tuple) else (model_state,)))
    ref = None
    if opts.lora_rank:
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
