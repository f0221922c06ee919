"""Fused (Pallas) kernels for the packed-row branch mask: TPU splash attention and the Pallas GPU (Triton) `mha`.

Dimension legend: B batch, T row length (queries and keys of one row), N query heads, K kv heads, H query/key head
dim, E value head dim (H for GQA, v_head_dim for MLA), D = max(H, E).

The mask is `flash.block_mask`: query i may attend key j iff j <= i, both have the same non-zero segment id, and j's
branch is 0 (shared prompt) or equal to i's branch. That rule is not an equivalence relation (the prompt is visible
to every completion, completions not to each other), so no segment-id encoding expresses it for kernels whose mask
is `q_id == kv_id` + causal. Two exact reformulations, both checked against `flash.blockwise_attention`
(tests/posttrain/model/test_fused_attention.py):

  * splash (TPU; `jax.experimental.pallas.ops.tpu.splash_attention`, separate q and kv segment ids): two causal
    kernel calls, merged by log-sum-exp. (A) keys of the shared prompt: q id = segment, kv id = segment where
    branch == 0 else a sentinel; (B) keys of the query's own completion: q and kv ids = (segment, branch) for
    completion tokens, sentinels otherwise (prompt queries see only call A). L = logaddexp(LA, LB),
    O = OA exp(LA - L) + OB exp(LB - L); a row with no key in a call has lse ~ mask_value (-0.7 float32 max), so
    its weight is exactly 0. Backward: one custom VJP around the merged op runs each call's own splash backward
    with residuals (q, k, v, that call's ids, merged O, merged L) and dO. FlashAttention-2's backward restricted to
    a subset of keys, given the global O and LSE (D = rowsum(dO * O)), is exactly those keys' share of the
    gradient (Dao 2023, arXiv:2307.08691, Algorithm 2), so dq = dqA + dqB, dk = dkA + dkB, dv = dvA + dvB.
  * pallas_gpu (`jax.experimental.pallas.ops.gpu.attention.mha`: one id array for q and kv, so call A cannot be
    written): a private copy of that module whose `segment_mask` evaluates the branch rule on ids packed as
    (segment << BRANCH_BITS) | branch. One kernel call, the kernel's own forward and backward (exact gradients).
    GQA by repeating kv heads (autodiff sums their gradients); MLA (E != H) by zero-padding q, k, v to D.

Rows are padded to the kernel block with segment 0 (padding); padding queries get output 0 like the reference.
Splash runs its separate dq backward kernel: the fused one (use_fused_bwd_kernel) keeps dq per kv block (two
[B, N, kv blocks, T, H] dq-partial buffers). `bench/attention.py` compares the implementations with blockwise.
Ids must satisfy 0 <= branch < 2**BRANCH_BITS and 0 <= segment < 2**(31 - BRANCH_BITS) (unchecked: traced).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "blockwise", "splash", "pallas_gpu", "dense")
BRANCH_BITS = 12
SPLASH_BLOCK = 512  # TPU block length (q and kv, forward and backward); capped at the 128-rounded row length
GPU_BLOCK = 128  # the Pallas GPU kernel's forward blocks (its defaults; backward blocks 32)
GPU_MAX_HEAD_DIM = 256


def mesh_platform() -> str:
    """The platform compiled for: the active (abstract) mesh's device platform, else `jax.default_backend()`.
    AOT compiles for TPU / GPU run on a CPU host, so the mesh, not the process backend, decides."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def resolve_impl(impl: str, platform: str, H: int, E: int) -> str:
    """The implementation `impl` runs as on `platform`: "auto" -> splash on TPU, pallas_gpu on GPU when
    max(H, E) <= GPU_MAX_HEAD_DIM, else blockwise; any other name of IMPLS is returned as is.
    Raises ValueError for a name not in IMPLS."""
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
    """Branch-masked self-attention with TPU splash attention: two causal calls merged by log-sum-exp, gradients
    from splash's own backward kernels (module doc).

    q/k/v as in `flash.blockwise_attention` (one dtype; GQA: N a multiple of K; MLA: E may differ from H);
    segment_BxT, branch_BxT: int32 ids (0 = padding / shared prompt). block: kernel block length (multiple of
    128; capped at T rounded up to 128); T is zero-padded to a multiple of it. interpret: run the kernels in the
    Pallas interpreter (CPU tests). Returns [B, T, N, E] in q's dtype; padding queries get 0.
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
    """bool [Q, C]: `flash.block_mask` without its causal part, on ids packed as (segment << BRANCH_BITS) | branch
    (the segment test of the Pallas GPU kernel, which adds causality itself)."""
    low = (1 << BRANCH_BITS) - 1
    qs, qb = q_ids_Q[:, None] >> BRANCH_BITS, q_ids_Q[:, None] & low
    ks, kb = kv_ids_C[None, :] >> BRANCH_BITS, kv_ids_C[None, :] & low
    return (qs == ks) & (ks != 0) & ((kb == 0) | (kb == qb))


@functools.cache
def _tree_mha_module():
    """A private copy of `jax.experimental.pallas.ops.gpu.attention` whose kernels call `tree_segment_mask`
    (the kernels look `segment_mask` up in their module's globals at trace time; the upstream module is untouched)."""
    from jax.experimental.pallas.ops.gpu import attention as upstream
    spec = importlib.util.spec_from_file_location("posttrain_tree_mha", upstream.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    module.segment_mask = tree_segment_mask
    return module


def gpu_block_sizes(module, head_dim: int):
    """The Pallas GPU kernel's block sizes: its defaults (forward 128 x 128, backward 32) up to head dim 128; above
    (the kernel pads to 256), forward key blocks of 64: with 128-key blocks, head dim 192 (DeepSeek-V3's MLA)
    needs 328,192 bytes of shared memory per block, over an H200's 232,448; 64-key blocks fit head dims 192
    and 256."""
    sizes = module.BlockSizes.get_default()
    return dataclasses.replace(sizes, block_k=64) if head_dim > 128 else sizes


def pallas_gpu_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT, scale: float, *,
                         interpret: bool = False) -> jax.Array:
    """Branch-masked self-attention with the Pallas GPU (Triton) FlashAttention kernel in one call (module doc).

    Arguments as `splash_attention`; T is zero-padded to a multiple of GPU_BLOCK; kv heads are repeated to N and
    q, k, v zero-padded to D = max(H, E) (no change to the logits). Returns [B, T, N, E] in q's dtype; padding
    queries get 0. Gradients: the kernel's custom VJP (Triton backward).
    """
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
    """`splash_attention` (impl "splash") or `pallas_gpu_attention` ("pallas_gpu"), interpreted when `platform`
    is not the kernel's own. Under a mesh of more than one device the kernel runs per shard (`jax.shard_map`):
    batch split as the "batch" rule says and heads as "heads" where N and K divide (else replicated), since the
    kernels are custom calls that the SPMD partitioner cannot split. Returns [B, T, N, E] in q's dtype."""
    if impl == "splash":
        fn = functools.partial(splash_attention, scale=scale, interpret=platform != "tpu")
    elif impl == "pallas_gpu":
        fn = functools.partial(pallas_gpu_attention, scale=scale, interpret=platform not in ("gpu", "cuda"))
    else:
        raise ValueError(f"fused attention impl={impl!r}; expected 'splash' or 'pallas_gpu'")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxE, segment_BxT, branch_BxT)
    from posttrain.infra import mesh as mesh_lib
    from posttrain.infra.partitioning import current_rules

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
