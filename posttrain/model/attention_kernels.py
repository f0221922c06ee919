"""Fused (Pallas) kernels for the packed-row branch mask: TPU splash attention and the Pallas GPU (Triton) `mha`.

Exact reformulations of `blockwise_attention.block_mask`: docs/attention.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.infra import mesh as mesh_lib
from posttrain.infra.partitioning import current_rules

IMPLS = ("auto", "blockwise", "splash", "pallas_gpu", "dense")
BRANCH_BITS = 12
SPLASH_BLOCK = 512  # TPU block length (q and kv, forward and backward); capped at the 128-rounded row length
GPU_BLOCK = 128  # the Pallas GPU kernel's forward blocks (its defaults; backward blocks 32)
GPU_MAX_HEAD_DIM = 256


def mesh_platform() -> str:
    """The platform compiled for: the active mesh's (AOT compiles run on a CPU host), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def resolve_impl(impl: str, platform: str, H: int, E: int) -> str:
    """The implementation `impl` runs as on `platform`; "auto": splash on TPU, pallas_gpu on GPU, else blockwise.

    pallas_gpu needs max(H, E) <= GPU_MAX_HEAD_DIM. Raises ValueError for a name not in IMPLS."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda") and max(H, E) <= GPU_MAX_HEAD_DIM:
        return "pallas_gpu"
    return "blockwise"


def _pad_rows(x_BxTx_, T_pad):
    return jnp.pad(x_BxTx_, [(0, 0), (0, T_pad - x_BxTx_.shape[1])] + [(0, 0)] * (x_BxTx_.ndim - 2))


def _code(seg_BxT, br_BxT):
    return jnp.left_shift(seg_BxT, BRANCH_BITS) | br_BxT


# ----------------------------------------------------------------------------------------------------- splash (TPU)

def _splash_kernel(T: int, N: int, block: int, interpret: bool):
    """A save_residuals splash kernel (MHA form: K kv heads read by N / K query heads each) with a causal mask."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
                          use_fused_bwd_kernel=False)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(N)])
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True,
                              interpret=interpret)


@jax.custom_vjp
def _splash_pair(kernel, q_NxTxH, k_KxTxH, v_KxTxE, ids_a, ids_b):
    return _splash_pair_fwd(kernel, q_NxTxH, k_KxTxH, v_KxTxE, ids_a, ids_b)[0]


def _splash_pair_fwd(kernel, q_NxTxH, k_KxTxH, v_KxTxE, ids_a, ids_b):
    o_a, (l_a,) = kernel(q_NxTxH, k_KxTxH, v_KxTxE, ids_a)  # [N, T, E] q dtype, [N, T] float32
    o_b, (l_b,) = kernel(q_NxTxH, k_KxTxH, v_KxTxE, ids_b)
    lse = jnp.logaddexp(l_a, l_b)
    o = (o_a.astype(jnp.float32) * jnp.exp(l_a - lse)[..., None]
         + o_b.astype(jnp.float32) * jnp.exp(l_b - lse)[..., None])
    return o, (kernel, q_NxTxH, k_KxTxH, v_KxTxE, ids_a, ids_b, o, lse)


def _splash_pair_bwd(res, do_NxTxE):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    kernel, q, k, v, ids_a, ids_b, o, lse = res
    kw = kernel.kwargs
    grads = []
    for ids in (ids_a, ids_b):
        out = sk._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
            kw["attn_logits_soft_cap"], kw["interpret"],
            (q, k, v, ids, None, o, lse, kernel.dq_mask_info, kernel.dkv_mask_info), do_NxTxE.astype(q.dtype))
        grads.append(out[3:6])
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
    f32 = lambda a, b, like: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(like.dtype)
    return None, f32(dq_a, dq_b, q), f32(dk_a, dk_b, k), f32(dv_a, dv_b, v), None, None


_splash_pair.defvjp(_splash_pair_fwd, _splash_pair_bwd)


def splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT, scale: float, *,
                     block: int = SPLASH_BLOCK, interpret: bool = False) -> jax.Array:
    """Branch-masked self-attention [B, T, N, E] in q's dtype: two causal splash calls merged by log-sum-exp.

    Args:
      block: kernel block length, a multiple of 128 (capped at T rounded up to 128).
      interpret: run in the Pallas interpreter (CPU tests).
    """
    B, T, N, H = q_BxTxNxH.shape
    T128 = -(-T // 128) * 128
    block = min(block, T128)
    T_pad = -(-T // block) * block
    seg, br = (_pad_rows(a.astype(jnp.int32), T_pad) for a in (segment_BxT, branch_BxT))
    real, comp = seg != 0, (seg != 0) & (br != 0)
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds
    ids_a = SegmentIds(q=jnp.where(real, seg, -1), kv=jnp.where(real & (br == 0), seg, -2))
    code = _code(seg, br)
    ids_b = SegmentIds(q=jnp.where(comp, code, -1), kv=jnp.where(comp, code, -2))
    heads = lambda x: _pad_rows(x, T_pad).transpose(0, 2, 1, 3)  # [B, T, n, d] -> [B, n, T_pad, d]
    q = heads((q_BxTxNxH.astype(jnp.float32) * scale).astype(q_BxTxNxH.dtype))
    k, v = heads(k_BxTxKxH.astype(q.dtype)), heads(v_BxTxKxE.astype(q.dtype))
    kernel = _splash_kernel(T_pad, N, block, interpret)
    o = jax.vmap(_splash_pair, in_axes=(None, 0, 0, 0, 0, 0))(kernel, q, k, v, ids_a, ids_b)  # [B, N, T_pad, E] float32
    o = jnp.where(real[:, None, :, None], o, 0.0)
    return o.transpose(0, 2, 1, 3)[:, :T].astype(q_BxTxNxH.dtype)


# -------------------------------------------------------------------------------------------- Pallas GPU (Triton)

def tree_segment_mask(q_ids_Q, kv_ids_C) -> jax.Array:
    """bool [Q, C]: `blockwise_attention.block_mask` without causality, on ids (segment << BRANCH_BITS) | branch."""
    low = (1 << BRANCH_BITS) - 1
    qs, qb = q_ids_Q[:, None] >> BRANCH_BITS, q_ids_Q[:, None] & low
    ks, kb = kv_ids_C[None, :] >> BRANCH_BITS, kv_ids_C[None, :] & low
    return (qs == ks) & (ks != 0) & ((kb == 0) | (kb == qb))


@functools.cache
def _tree_mha_module():
    """A private copy of the Pallas GPU attention module whose kernels call `tree_segment_mask` (a global at trace)."""
    from jax.experimental.pallas.ops.gpu import attention as upstream
    spec = importlib.util.spec_from_file_location("posttrain_tree_mha", upstream.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    module.segment_mask = tree_segment_mask
    return module


def gpu_block_sizes(module, head_dim: int):
    """The Pallas GPU kernel's default block sizes, with 64-key forward blocks above head dim 128 (shared memory)."""
    sizes = module.BlockSizes.get_default()
    return dataclasses.replace(sizes, block_k=64) if head_dim > 128 else sizes


def pallas_gpu_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT, scale: float, *,
                         interpret: bool = False) -> jax.Array:
    """Branch-masked self-attention [B, T, N, E] in one Pallas GPU (Triton) kernel call; args as `splash_attention`."""
    B, T, N, H = q_BxTxNxH.shape
    K, E = k_BxTxKxH.shape[2], v_BxTxKxE.shape[-1]
    D, T_pad = max(H, E), -(-T // GPU_BLOCK) * GPU_BLOCK
    dt = q_BxTxNxH.dtype
    pad = lambda x: jnp.pad(_pad_rows(x.astype(dt), T_pad), [(0, 0)] * 3 + [(0, D - x.shape[-1])])
    rep = lambda x: jnp.repeat(x, N // K, axis=2)
    seg, br = (_pad_rows(a.astype(jnp.int32), T_pad) for a in (segment_BxT, branch_BxT))
    module = _tree_mha_module()
    sizes = gpu_block_sizes(module, D)
    o = module.mha(pad(q_BxTxNxH), pad(rep(k_BxTxKxH)), pad(rep(v_BxTxKxE)), _code(seg, br), sm_scale=float(scale),
                   causal=True, block_sizes=sizes, interpret=interpret)
    o = jnp.where((seg != 0)[:, :, None, None], o, 0).astype(dt)
    return o[:, :T, :, :E]


# ----------------------------------------------------------------------------------------------------- dispatch

def fused(impl: str, q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT, scale: float, platform: str):
    """`splash_attention` or `pallas_gpu_attention` by `impl`, interpreted off the kernel's own platform.

    Under a multi-device mesh it runs per shard (`jax.shard_map`): batch by the "batch" rule, heads where N, K fit."""
    if impl == "splash":
        fn = functools.partial(splash_attention, scale=scale, interpret=platform != "tpu")
    elif impl == "pallas_gpu":
        fn = functools.partial(pallas_gpu_attention, scale=scale, interpret=platform not in ("gpu", "cuda"))
    else:
        raise ValueError(f"fused attention impl={impl!r}; expected 'splash' or 'pallas_gpu'")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT)

    def axes(name, *sizes):  # the mesh axes of logical `name` if their size divides every one of sizes
        entry = mesh_lib.logical_to_spec((name,), current_rules())[0]
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n = int(np.prod([mesh.shape[a] for a in names]))
        return entry if n > 1 and all(s % n == 0 for s in sizes) else None

    P = jax.sharding.PartitionSpec
    b, h = axes("batch", q_BxTxNxH.shape[0]), axes("heads", q_BxTxNxH.shape[2], k_BxTxKxH.shape[2])
    heads, rows = P(b, None, h, None), P(b, None)
    return jax.shard_map(lambda *a: fn(*a), mesh=mesh, in_specs=(heads, heads, heads, rows, rows),
                         out_specs=heads, check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT)
