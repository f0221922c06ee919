"""Writing one token entry per sequence into a page pool in place on TPU: a Pallas (Mosaic) kernel.

XLA:TPU copies a pool written by several scatters; this kernel's output aliases it (docs/engine.md).
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def write_rows_pallas_tpu(pages_KxPxZxH: jax.Array, new_SxKxH: jax.Array, page_S: jax.Array, offset_S: jax.Array,
                          interpret: bool = False) -> jax.Array:
    """Write new_SxKxH[s] into pages_KxPxZxH at (page_S[s], offset_S[s]) for every s, in place.

    The result aliases the input: donate the pool to the caller's jit.

    Args:
      pages_KxPxZxH: one pool array (any float dtype; [1, P, Z, C] for MLA's "kv").
      new_SxKxH: the entries, cast to the pool's dtype.
      page_S, offset_S: int targets, page_S in [0, P) and offset_S in [0, Z) (not checked on the device).
      interpret: run in the Pallas interpreter (any platform).
    Returns:
      [K, P, Z, H], the pool's dtype.
    Raises:
      ValueError: new_SxKxH not [S, K, H] of the pool's K and H, or page_S / offset_S not [S].
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    K, _, Z, H = pages_KxPxZxH.shape
    S = new_SxKxH.shape[0]
    if new_SxKxH.shape != (S, K, H) or page_S.shape != (S,) or offset_S.shape != (S,):
        raise ValueError(f"write_rows_pallas_tpu: pages {pages_KxPxZxH.shape} need entries [S, {K}, {H}] and "
                         f"targets [S]; got entries {new_SxKxH.shape}, pages {page_S.shape}, offsets "
                         f"{offset_S.shape}")

    def kernel(page_ref, offset_ref, new_ref, pages_in, pages_out, buf, sem):
        del pages_in  # aliased to pages_out

        def one(s, carry):
            page = page_ref[s]
            read = pltpu.make_async_copy(pages_out.at[:, pl.ds(page, 1)], buf, sem)
            read.start()
            read.wait()
            rows = jax.lax.broadcasted_iota(jnp.int32, (K, 1, Z, H), 2)
            new = new_ref[pl.ds(s, 1)].reshape(K, 1, 1, H)
            buf[...] = jnp.where(rows == offset_ref[s], jnp.broadcast_to(new, (K, 1, Z, H)), buf[...])
            write = pltpu.make_async_copy(buf, pages_out.at[:, pl.ds(page, 1)], sem)
            write.start()
            write.wait()
            return carry

        jax.lax.fori_loop(0, S, one, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((K, 1, Z, H), pages_KxPxZxH.dtype), pltpu.SemaphoreType.DMA(())])
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(pages_KxPxZxH.shape, pages_KxPxZxH.dtype),
                          grid_spec=grid_spec, input_output_aliases={3: 0}, interpret=interpret)(
        page_S.astype(jnp.int32), offset_S.astype(jnp.int32), new_SxKxH.astype(pages_KxPxZxH.dtype), pages_KxPxZxH)
