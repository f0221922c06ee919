"""Content checksums of a checkpoint's arrays: Fletcher-style 32-bit sums, independent of sharding and backend.

Bit rot that still decodes is caught on restore instead of trained on. The sums: docs/checkpoint_formats.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORDS = {8: jnp.uint32, 4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


def _supported(dtype) -> bool:
    """Whether `dtype`'s bits can be read as words (not the 4-bit types, whose elements share a byte)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return True
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else (
        jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else 0)
    return bits == 8 * dtype.itemsize and dtype.itemsize in _WORDS


def _sums(x) -> jax.Array:
    """[s1, s2] uint32 of one array (docs/checkpoint_formats.md)."""
    if x.dtype == jnp.bool_:
        w = x.astype(jnp.uint32)
    else:
        w = jax.lax.bitcast_convert_type(x, _WORDS[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):  # the row-major position of each word, without reshaping the array
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2 ** 32)
        stride *= w.shape[d]
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum((index + 1) * w, dtype=jnp.uint32)])


@jax.jit
def _all_sums(leaves):
    return [_sums(x) for x in leaves]


def checksums(leaves) -> list[list[int] | None]:
    """[s1, s2] (Python ints) of each jax or NumPy array in `leaves`, any sharding; None for 4-bit types."""
    picked = [i for i, x in enumerate(leaves) if _supported(x.dtype)]
    sums = _all_sums([leaves[i] for i in picked]) if picked else []
    out: list[list[int] | None] = [None] * len(leaves)
    for i, s in zip(picked, sums):
        out[i] = [int(v) for v in np.asarray(s.addressable_data(0) if isinstance(s, jax.Array) else s)]
    return out


def mismatches(paths, saved, read) -> list[str]:
    """"path: saved [s1, s2], read [s1, s2]" of each leaf whose saved checksum (when not None) differs from `read`."""
    return [f"{p}: saved {s}, read {r}" for p, s, r in zip(paths, saved, read) if s is not None and list(s) != r]
