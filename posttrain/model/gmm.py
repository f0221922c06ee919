"""Grouped matmul for Mixture-of-Experts: rows sorted by expert, each contiguous group times its expert's weight.

The implementations (`IMPLS`) agree in values and gradients; docs/moe.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLS = ("auto", "ragged", "padded", "megablox", "capacity")


def auto_impl(platform: str | None = None) -> str:
    """The implementation "auto" resolves to on `platform` (default: `jax.default_backend()`)."""
    platform = platform or jax.default_backend()
    return "megablox" if platform == "tpu" else "padded"


def default_block(rows: int, groups: int) -> int:
    """Block rows for "padded": the power of two at or below the mean group size, within [8, 1024] (docs/moe.md)."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(1024, max(8, 1 << (mean.bit_length() - 1))))


def grouped_matmul(x_MxD: jax.Array, w_ExDxF: jax.Array, sizes_E: jax.Array, *, impl: str = "auto",
                   block: int | None = None, capacity: int | None = None, precision=None,
                   out_dtype=jnp.float32, platform: str | None = None) -> jax.Array:
    """y [M, F] in `out_dtype` (float32 accumulation): x[r] @ w[group(r)] for rows sorted by group.

    Args:
      sizes_E: int32 rows per group (sum <= M); rows past the sum give 0.
      block: rows per block for "padded" (default `default_block`).
      capacity: rows per group for "capacity" (required there); rows over it are silently lost.
      platform: the backend compiled for (default `jax.default_backend()`): picks "auto" and megablox's interpret.
    Raises:
      ValueError: an unknown impl, mismatched shapes or a missing capacity.
    """
    M, D = x_MxD.shape
    E, Dw, F = w_ExDxF.shape
    if Dw != D or sizes_E.shape != (E,):
        raise ValueError(f"grouped_matmul: x {x_MxD.shape}, w {w_ExDxF.shape}, sizes {sizes_E.shape} do not match")
    platform = platform or jax.default_backend()
    impl = auto_impl(platform) if impl == "auto" else impl
    sizes_E = sizes_E.astype(jnp.int32)
    if impl == "ragged":
        y = jax.lax.ragged_dot(x_MxD, w_ExDxF, sizes_E, precision=precision, preferred_element_type=jnp.float32)
    elif impl == "padded":
        y = _padded(x_MxD, w_ExDxF, sizes_E, block or default_block(M, E), precision)
    elif impl == "megablox":
        y = _megablox(x_MxD, w_ExDxF, sizes_E, interpret=platform != "tpu")
    elif impl == "capacity":
        if not capacity:
            raise ValueError("grouped_matmul(impl='capacity') needs capacity > 0")
        y = _capacity(x_MxD, w_ExDxF, sizes_E, capacity, precision)
    else:
        raise ValueError(f"grouped_matmul: impl={impl!r}; expected one of {IMPLS}")
    return y.astype(out_dtype)


def _group_of_rows(sizes_E, M):
    """Group id of every row [M] int32; rows past sum(sizes) get E."""
    ends = jnp.cumsum(sizes_E)
    return jnp.searchsorted(ends, jnp.arange(M, dtype=jnp.int32), side="right").astype(jnp.int32)


def _padded(x_MxD, w_ExDxF, sizes_E, block, precision):
    M, D = x_MxD.shape
    E, _, F = w_ExDxF.shape
    Nb = M // block + E  # sum_e ceil(s_e / block) <= sum_e (floor(s_e / block) + 1) <= M // block + E
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    blocks_E = (sizes_E + block - 1) // block
    pstarts_E = block * (jnp.cumsum(blocks_E) - blocks_E)  # padded start row of each group
    # each padded slot p: its group, and the source row it holds (or M: padding)
    block_group_Nb = jnp.searchsorted(jnp.cumsum(blocks_E), jnp.arange(Nb, dtype=jnp.int32), side="right")
    slot_group = jnp.repeat(block_group_Nb, block, total_repeat_length=Nb * block)
    g = jnp.minimum(slot_group, E - 1)
    offset = jnp.arange(Nb * block, dtype=jnp.int32) - pstarts_E[g]
    valid = (slot_group < E) & (offset < sizes_E[g])
    src = jnp.where(valid, starts_E[g] + offset, M)
    xp = jnp.concatenate([x_MxD, jnp.zeros((1, D), x_MxD.dtype)])[src].reshape(Nb, block, D)
    w_blocks = w_ExDxF[jnp.minimum(block_group_Nb, E - 1)]  # [Nb, D, F]
    yp = jnp.einsum("nbd,ndf->nbf", xp, w_blocks, precision=precision, preferred_element_type=jnp.float32)
    # back to row order: row r sits at padded slot pstart[g] + (r - start[g])
    group_M = _group_of_rows(sizes_E, M)
    gm = jnp.minimum(group_M, E - 1)
    dest = jnp.where(group_M < E, pstarts_E[gm] + jnp.arange(M, dtype=jnp.int32) - starts_E[gm], Nb * block)
    return jnp.concatenate([yp.reshape(Nb * block, F), jnp.zeros((1, F), yp.dtype)])[dest]


def _capacity(x_MxD, w_ExDxF, sizes_E, C, precision):
    M, D = x_MxD.shape
    E, _, F = w_ExDxF.shape
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    slot = jnp.arange(C, dtype=jnp.int32)
    src_ExC = jnp.where(slot[None, :] < sizes_E[:, None], starts_E[:, None] + slot[None, :], M)
    xc = jnp.concatenate([x_MxD, jnp.zeros((1, D), x_MxD.dtype)])[src_ExC]  # [E, C, D]
    yc = jnp.einsum("ecd,edf->ecf", xc, w_ExDxF, precision=precision, preferred_element_type=jnp.float32)
    group_M = _group_of_rows(sizes_E, M)
    gm = jnp.minimum(group_M, E - 1)
    pos = jnp.arange(M, dtype=jnp.int32) - starts_E[gm]
    dest = jnp.where((group_M < E) & (pos < C), gm * C + pos, E * C)
    return jnp.concatenate([yc.reshape(E * C, F), jnp.zeros((1, F), yc.dtype)])[dest]


@functools.cache
def _megablox_ops():
    from jax.experimental.pallas.ops.tpu.megablox import ops

    return ops


def _megablox(x_MxD, w_ExDxF, sizes_E, *, interpret):
    """megablox.gmm on rows padded to its tile; rows outside every group (left uninitialised) are masked by `where`."""
    M, D = x_MxD.shape
    F = w_ExDxF.shape[2]
    tm = min(128, -(-M // 8) * 8)
    Mp = -(-M // tm) * tm
    valid = (jnp.arange(Mp) < jnp.sum(sizes_E))[:, None]
    xp = jnp.where(valid, jnp.pad(x_MxD, ((0, Mp - M), (0, 0))), 0).astype(w_ExDxF.dtype)
    tiling = (tm, min(128, D), min(128, F))
    y = _megablox_ops().gmm(xp, w_ExDxF, sizes_E, jnp.float32, tiling, None, None, False, interpret)
    return jnp.where(valid, y, 0)[:M]
