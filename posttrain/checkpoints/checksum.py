"""Content checksums of the arrays a checkpoint stores, so that bit rot which still decodes (a flipped bit inside
a compressed chunk, a disk that returns wrong bytes) is caught on restore instead of trained on.

Dimension legend: none (any array shape).

A leaf's checksum is Fletcher-style: two 32-bit sums over its little-endian words w_i (i in row-major order;
8-byte types give two words per element, 2- and 1-byte types one zero-extended word each):
    s1 = sum_i w_i mod 2^32,    s2 = sum_i (i + 1) * w_i mod 2^32.
s1 changes with any change of one word (a single flipped bit changes it by 2^k); s2 also with a reordering.
Integer sums mod 2^32 are exact in any order, so the value does not depend on the sharding, the number of
devices or the backend that computes it: a checkpoint written on one mesh verifies on another. The sums run as
one jitted program over the whole tree (a reduction per leaf, no copy); they are read from the first addressable
shard of the replicated result, so every process gets them (multi-host).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORDS = {8: jnp.uint32, 4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


def _supported(dtype) -> bool:
    """Whether `dtype`'s bits can be read as words: a bool, or a type whose size in bits is 8 x its itemsize
    (not the 4-bit types, whose elements share a byte)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return True
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else (
        jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else 0)
    return bits == 8 * dtype.itemsize and dtype.itemsize in _WORDS


def _sums(x) -> jax.Array:
    """[s1, s2] uint32 of one array (module doc)."""
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
    """[s1, s2] (Python ints) of each array in `leaves` (jax or NumPy arrays, any sharding); None for a dtype whose
    bits are not words (4-bit types)."""
    picked = [i for i, x in enumerate(leaves) if _supported(x.dtype)]
    sums = _all_sums([leaves[i] for i in picked]) if picked else []
    out: list[list[int] | None] = [None] * len(leaves)
    for i, s in zip(picked, sums):
        out[i] = [int(v) for v in np.asarray(s.addressable_data(0) if isinstance(s, jax.Array) else s)]
    return out


def mismatches(paths, saved, read) -> list[str]:
    """"path: saved [s1, s2], read [s1, s2]" for each leaf whose saved checksum (not None: a checkpoint written
    before checksums, or a 4-bit leaf, has none) differs from the one computed on what was read."""
    return [f"{p}: saved {s}, read {r}" for p, s, r in zip(paths, saved, read) if s is not None and list(s) != r]
