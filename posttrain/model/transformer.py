"""Decoder-only transformer: embed -> scan(dense blocks) -> scan(MoE blocks) -> RMSNorm -> unembed.

Teacher-forced passes over packed rows (`hidden_states`), the dense KV-cache sampler (`prefill`, `decode_step`) and
attention over a caller's cache (`extend_with_hook`). Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from posttrain.model.config import ModelConfig
from posttrain.model.attention import (DecodeCache, Source, cache_len, cache_seq_axis, to_cache_layout,
                                       write_position)
from posttrain.model.blockwise_attention import self_mask
from posttrain.model.layers import CHECKPOINT_NAMES, MLP, Attention, MLAttention, RMSNorm, dot, param
from posttrain.model.moe import MoE
from posttrain.infra.partitioning import with_logical_constraint
from posttrain.infra.precision import DTYPES as _DT
from posttrain.infra.precision import matmul_scope


def remat_policy(remat: str, names: tuple[str, ...] = ()):
    """The `jax.checkpoint` policy of a remat mode (docs/precision.md), None for "none"; ValueError if unknown."""
    if set(names) - set(CHECKPOINT_NAMES):
        raise ValueError(f"unknown remat names {sorted(set(names) - set(CHECKPOINT_NAMES))}; known: {CHECKPOINT_NAMES}")
    policies = {"dots": lambda: jax.checkpoint_policies.save_only_these_names("dot"),
                "names": lambda: jax.checkpoint_policies.save_only_these_names(*names),
                "full": lambda: jax.checkpoint_policies.nothing_saveable}
    if remat == "none":
        return None
    if remat not in policies:
        raise ValueError(f"remat={remat!r}; expected none|{'|'.join(policies)}")
    return policies[remat]()


def _in_precision_scope(method):
    """Runs a Transformer entry point under its `matmul_scope`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with matmul_scope(self.matmul_precision):
            return method(self, *args, **kwargs)

    return wrapper


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + ffn(norm(x)). `ffn` is an MLP or a MoE."""

    def __init__(self, attn: nnx.Module, ffn: nnx.Module, *, d_model: int, eps: float, param_dtype, rngs):
        self.attn, self.ffn = attn, ffn
        self.input_norm = RMSNorm(d_model, eps, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(d_model, eps, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, mask, extra_sources=(), valid=None, replay=None):
        h, entries = self.attn(self.input_norm(x), positions, mask, extra_sources)
        x = x + h
        ffn_in = checkpoint_name(self.post_attn_norm(x), "mlp_in")
        if isinstance(self.ffn, MoE):
            f, aux = self.ffn(ffn_in, valid, replay)
        else:
            f, aux = self.ffn(ffn_in), {}
        x = with_logical_constraint(x + f, ("batch", "length", "embed"))
        return x, entries, aux


def stack_layers(make_block, num: int, rngs: nnx.Rngs) -> nnx.Module:
    """Builds `num` blocks with independent init keys and stacks their state on a leading `layers` axis."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_block(nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), num)
    state = jax.vmap(lambda k: nnx.state(make_block(nnx.Rngs(params=k))))(keys)

    def add_axis(v):
        axes = v.get_metadata().get("logical_axes")
        return v.replace(logical_axes=("layers",) + tuple(axes)) if axes is not None else v

    state = jax.tree.map(add_axis, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class Transformer(nnx.Module):
    """The decoder. Construct under `posttrain.infra.partitioning.create_sharded` to create parameters sharded."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.num_dense, self.num_moe = cfg.num_dense_layers, cfg.num_moe_layers
        self.tie_embeddings, self.remat, self.remat_names = cfg.tie_embeddings, cfg.remat, tuple(cfg.remat_names)
        self.grad_dtype = cfg.grad_dtype
        self.matmul_precision = cfg.matmul_precision
        self.dtype, pdt = _DT[cfg.dtype], _DT[cfg.param_dtype]
        D, V = cfg.d_model, cfg.vocab_size
        self.embedding = param(rngs, (V, D), ("vocab", "embed"), pdt, std=0.02)

        def make_attn(r):
            if cfg.mla is not None:
                return MLAttention(d_model=D, num_heads=cfg.num_heads, mla=cfg.mla, rope=cfg.rope,
                                   norm_eps=cfg.norm_eps, dtype=self.dtype, param_dtype=pdt, rngs=r, lora=cfg.lora,
                                   matmul_precision=cfg.matmul_precision, attention_impl=cfg.attention_impl)
            return Attention(d_model=D, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, rope=cfg.rope, qk_norm=cfg.qk_norm, bias=cfg.attention_bias,
                             norm_eps=cfg.norm_eps, dtype=self.dtype, param_dtype=pdt, rngs=r, lora=cfg.lora,
                             matmul_precision=cfg.matmul_precision, attention_impl=cfg.attention_impl)

        def make_dense(r):
            mlp_dim = cfg.moe.dense_mlp_dim if cfg.moe is not None else cfg.mlp_dim
            ffn = MLP(d_model=D, mlp_dim=mlp_dim, dtype=self.dtype, param_dtype=pdt, rngs=r, lora=cfg.lora,
                      matmul_precision=cfg.matmul_precision)
            return Block(make_attn(r), ffn, d_model=D, eps=cfg.norm_eps, param_dtype=pdt, rngs=r)

        def make_moe(r):
            ffn = MoE(d_model=D, moe=cfg.moe, dtype=self.dtype, param_dtype=pdt, rngs=r, lora=cfg.lora,
                      matmul_precision=cfg.matmul_precision, gmm_impl=cfg.moe_gmm_impl,
                      capacity_factor=cfg.moe_capacity_factor, ep_capacity_factor=cfg.moe_ep_capacity_factor)
            return Block(make_attn(r), ffn, d_model=D, eps=cfg.norm_eps, param_dtype=pdt, rngs=r)

        self.dense_layers = stack_layers(make_dense, self.num_dense, rngs) if self.num_dense else None
        self.moe_layers = stack_layers(make_moe, self.num_moe, rngs) if self.num_moe else None
        self.final_norm = RMSNorm(D, cfg.norm_eps, param_dtype=pdt, rngs=rngs)
        self.lm_head = None if cfg.tie_embeddings else param(rngs, (D, V), ("embed", "vocab"), pdt, fan_in=D)

    # ------------------------------------------------------------------ shared pieces
    def stacks(self):
        """(name, stacked module) for each non-empty layer stack, in execution order."""
        return [(n, m) for n, m in (("dense", self.dense_layers), ("moe", self.moe_layers)) if m is not None]

    def embed(self, tokens_BxT):
        x = jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(self.dtype)
        return with_logical_constraint(x, ("batch", "length", "embed"))

    def unembedding(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        return self.embedding[...].T if self.tie_embeddings else self.lm_head[...]

    @_in_precision_scope
    def logits(self, h_BxTxD) -> jax.Array:
        """float32 logits [..., V] from final hidden states."""
        return dot("...d,dv->...v", h_BxTxD, self.unembedding(), self.dtype).astype(jnp.float32)

    def _scan(self, stack, x, xs, body, carry_extra=None, weights_in_compute_dtype: bool = False):
        graphdef, state = nnx.split(stack)
        if weights_in_compute_dtype:
            state = matrices_in_dtype(state, self.dtype)

        def step(carry, inputs):
            layer_state, extra = inputs
            return body(nnx.merge(graphdef, layer_state), carry, extra)

        if self.remat != "none":
            step = jax.checkpoint(step, policy=remat_policy(self.remat, self.remat_names), prevent_cse=False)
        return jax.lax.scan(step, x if carry_extra is None else (x, carry_extra), (state, xs))

    # ------------------------------------------------------------------ teacher-forced / prefill
    @_in_precision_scope
    def hidden_states(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, branch_ids_BxT=None,
                      *, return_entries: bool = False, shared_entries=None, blockwise: bool | None = None,
                      replay_experts_LxBxTxk=None):
        """(final-norm hidden states [B, T, D], aux[, {stack: attention entries [L, B, T, ...]}]).

        Args:
          shared_entries: {stack: [L, 1, ...]} cache-layout entries of C tokens every row continues (positions from C).
          blockwise: True, False (dense; always with shared_entries) or None by shape (`blockwise_attention.self_mask`).
          replay_experts_LxBxTxk: routing replay for the MoE stack (-1: route normally).
        Returns:
          aux: MoE losses summed over layers, "expert_load" [L, E], "routed_experts" int32 [L, B, T, k].
        """
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.ones((B, T), jnp.int32)
        if branch_ids_BxT is None:
            branch_ids_BxT = jnp.zeros((B, T), jnp.int32)
        mask = self_mask(segment_ids_BxT, branch_ids_BxT, False if shared_entries is not None else blockwise)
        valid = segment_ids_BxT != 0
        x = self.embed(tokens_BxT)
        entries, auxes = {}, []

        def body(block, h, inputs):
            shared_l, replay_l = inputs
            sources = ()
            if shared_l is not None:  # every row attends to all C shared tokens
                sources = (Source(shared_l, jnp.ones((1, 1, cache_len(shared_l)), bool), B),)
            h, ent, aux = block(h, positions_BxT, mask, sources, valid, replay_l)
            return h, (ent if return_entries else None, aux)

        for name, stack in self.stacks():
            shared = None if shared_entries is None else shared_entries[name]
            x, (ent, aux) = self._scan(stack, x, (shared, replay_experts_LxBxTxk if name == "moe" else None), body,
                                       weights_in_compute_dtype=self.grad_dtype == "compute")
            entries[name] = ent
            auxes.append(aux)
        aux = _merge_aux(auxes)
        h = self.final_norm(x)
        return (h, aux, entries) if return_entries else (h, aux)

    @_in_precision_scope
    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, branch_ids_BxT=None):
        """float32 logits [B, T, V] and the aux dict."""
        h, aux = self.hidden_states(tokens_BxT, positions_BxT, segment_ids_BxT, branch_ids_BxT)
        return self.logits(h), aux

    @_in_precision_scope
    def prefill(self, prompts_PxLp, lengths_P, *, group: int, max_new: int, shared_len: int = 0,
                return_routing: bool = False):
        """Runs right-padded prompts once: (logits [P, V] at each last token, DecodeCache[, routing]).

        The cache has an empty suffix of width `max_new` for P * group samples; routing (`return_routing`): the
        expert selection of every prompt token, int32 [L, P, Lp, k], None without MoE layers.
        shared_len: C > 0 when every prompt starts with the same C tokens (C < every length): they run once.
        """
        P, Lp = prompts_PxLp.shape
        shared, routing = None, []
        if shared_len:
            _, aux, shared = self.hidden_states(prompts_PxLp[:1, :shared_len], return_entries=True)
            shared = {name: to_cache_layout(e) for name, e in shared.items()}
            prompts_PxLp, lengths_P = prompts_PxLp[:, shared_len:], lengths_P - shared_len
            Lp = Lp - shared_len
            if "routed_experts" in aux:
                r = aux["routed_experts"]
                routing.append(jnp.broadcast_to(r, (r.shape[0], P) + r.shape[2:]))
        segment = (jnp.arange(Lp)[None, :] < lengths_P[:, None]).astype(jnp.int32)
        positions = jnp.broadcast_to(shared_len + jnp.arange(Lp, dtype=jnp.int32), (P, Lp))
        h, aux, entries = self.hidden_states(prompts_PxLp, positions, segment, None, return_entries=True,
                                             shared_entries=shared)
        if "routed_experts" in aux:
            routing.append(aux["routed_experts"])
        last = jnp.take_along_axis(h, (lengths_P - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        entries = {name: to_cache_layout(e) for name, e in entries.items()}

        def empty(name, e):  # [L, P * group, ...] with max_new positions
            shape = list(e.shape)
            shape[1], shape[cache_seq_axis(name)] = P * group, max_new
            return jnp.zeros(shape, e.dtype)

        suffix = {stack: {name: empty(name, e) for name, e in ent.items()} for stack, ent in entries.items()}
        cache = DecodeCache(entries, lengths_P.astype(jnp.int32), suffix, jnp.zeros((), jnp.int32), shared)
        if return_routing:
            return self.logits(last), cache, (jnp.concatenate(routing, axis=2) if routing else None)
        return self.logits(last), cache

    # ------------------------------------------------------------------ decoding
    @_in_precision_scope
    def decode_step(self, tokens_N, cache: DecodeCache, *, return_routing: bool = False):
        """Appends one token per sample: (next-token logits [N, V], cache[, expert selection int32 [L, N, k]])."""
        N = tokens_N.shape[0]
        P = cache.prefix_len_P.shape[0]
        G = N // P
        t = cache.step
        C = 0 if cache.shared is None else cache_len(next(iter(cache.shared.values())))
        positions = (C + jnp.repeat(cache.prefix_len_P, G) + t)[:, None]
        x = self.embed(tokens_N[:, None])
        Lp = cache_len(next(iter(cache.prefix.values())))
        prefix_mask = (jnp.arange(Lp)[None, :] < cache.prefix_len_P[:, None])[:, None, :]
        width = cache_len(next(iter(cache.suffix.values())))
        suffix_mask = jnp.broadcast_to((jnp.arange(width) < t)[None, None, :], (N, 1, width))
        self_mask = jnp.ones((N, 1, 1), bool)
        valid = jnp.ones((N, 1), bool)
        new_suffix, routing = {}, None
        for name, stack in self.stacks():
            # Cache slices are scan inputs and the new entries are written once after the scan: carrying the whole
            # suffix through the layer scan makes XLA:CPU copy it twice per layer per step.
            def body(block, h, inputs):
                prefix_l, suffix_l, shared_l = inputs
                sources = (Source(prefix_l, prefix_mask, G), Source(suffix_l, suffix_mask, 1))
                if shared_l is not None:
                    sources = (Source(shared_l, jnp.ones((1, 1, C), bool), N),) + sources
                h, ent, aux = block(h, positions, self_mask, sources, valid)
                return h, (ent, aux.get("routed_experts"))

            shared = None if cache.shared is None else cache.shared[name]
            x, (ent, routed) = self._scan(stack, x, (cache.prefix[name], cache.suffix[name], shared), body)
            routing = routed[:, :, 0] if routed is not None else routing
            new_suffix[name] = {k: write_position(cache.suffix[name][k], e, k, t)
                                for k, e in to_cache_layout(ent).items()}
        logits = self.logits(self.final_norm(x))[:, 0]
        cache = cache._replace(suffix=new_suffix, step=t + 1)
        return (logits, cache, routing) if return_routing else (logits, cache)

    @_in_precision_scope
    def decode_with_hook(self, tokens_B, positions_B, cache_xs: dict, make_hook, *, return_routing: bool = False,
                         cache_carry: dict | None = None):
        """`extend_with_hook` of one token per row, returning float32 logits [B, V] instead of hidden states."""
        h, entries, *rest = self.extend_with_hook(tokens_B[:, None], positions_B[:, None], cache_xs, make_hook,
                                                  return_routing=return_routing, cache_carry=cache_carry)
        if return_routing and rest[0] is not None:
            rest[0] = rest[0][:, :, 0]
        return (self.logits(h)[:, 0], entries) + tuple(rest)

    @_in_precision_scope
    def extend_with_hook(self, tokens_BxT, positions_BxT, cache_xs: dict, make_hook, valid_BxT=None, *,
                         return_routing: bool = False, cache_carry: dict | None = None):
        """T new tokens per row whose attention over earlier tokens and each other the caller's hook computes.

        Args:
          cache_xs: {stack: pytree with a leading [L] axis}, scanned with the layers; make_hook(xs) -> `CacheHook`.
          valid_BxT: bool, False for padding (MoE routing skips it).
          cache_carry: {stack: pytree} carried through the layer scan (a cache updated in place, e.g. the page
            pool; a scanned slice handed to a kernel is copied); make_hook(xs, cell) then reads and replaces cell[0].
        Returns:
          (hidden states [B, T, D], {stack: new entries [L, B, T, ...]}), then with `return_routing` the expert
          selection int32 [L, B, T, k] (or None), then with `cache_carry` {stack: the final carry}.
        """
        B, T = tokens_BxT.shape
        x = self.embed(tokens_BxT)
        self_mask = jnp.ones((B, T, T), bool)  # unused: the hook computes the attention
        valid = jnp.ones((B, T), bool) if valid_BxT is None else valid_BxT
        entries, routing, carried, carrying = {}, None, {}, cache_carry is not None
        for name, stack in self.stacks():
            def body(block, carry, xs_l):
                h, cell = (carry[0], [carry[1]]) if carrying else (carry, None)
                hook = make_hook(xs_l, cell) if carrying else make_hook(xs_l)
                h, ent, aux = block(h, positions_BxT, self_mask, (hook,), valid)
                return ((h, cell[0]) if carrying else h), (ent, aux.get("routed_experts"))

            x, (entries[name], routed) = self._scan(stack, x, cache_xs[name], body,
                                                    carry_extra=cache_carry[name] if carrying else None)
            if carrying:
                x, carried[name] = x
            routing = routed if routed is not None else routing
        out = (self.final_norm(x), entries) + ((routing,) if return_routing else ())
        return out + ((carried,) if carrying else ())


_FLOAT32_USES = ("router",)  # per-layer matrices used in float32 (MoE scores), never cast by `matrices_in_dtype`


def matrices_in_dtype(state, dtype):
    """`state` with every floating [L, ...] matrix stack cast to a narrower `dtype`, except `_FLOAT32_USES`."""
    narrow = jnp.dtype(dtype)

    def cast(path, x):
        keep = any(name in jax.tree_util.keystr(path) for name in _FLOAT32_USES)
        if (x.ndim >= 3 and jnp.issubdtype(x.dtype, jnp.floating) and narrow.itemsize < x.dtype.itemsize
                and not keep):
            return x.astype(narrow)
        return x

    return jax.tree_util.tree_map_with_path(cast, state)


def _merge_aux(auxes: list[dict]) -> dict:
    """Sums MoE losses over all MoE layers; keeps the per-layer expert load [L, E]; averages ep_dropped_frac."""
    out = {}
    for aux in auxes:
        for k, v in aux.items():
            if k == "routed_experts":  # [L, B, T, k] selections, kept as they are
                out[k] = v
            elif k == "expert_load":
                out[k] = v if k not in out else jnp.concatenate([out[k], v])
            elif k == "ep_dropped_frac":  # every MoE layer has the same count, so the mean over layers is exact
                out[k] = v.mean()
            else:
                out[k] = out.get(k, 0.0) + v.sum()
    return out
