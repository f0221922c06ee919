"""Attention of new tokens over a paged KV cache: a gather-based reference and the Pallas paged-attention kernels.

Page layout, `IMPLS` and the TPU page writes: docs/engine.md.
Shapes: the legend in `posttrain.types`.
"""
from __future__ import annotations

import contextlib
import logging
import math

import jax
import jax.numpy as jnp

from posttrain.generate.page_writes import write_rows_pallas_tpu

IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
MASK_VALUE = -1e9  # finite, as in posttrain.model.attention.NEG_INF


_KERNEL_OF = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}
_FLOATS = ("float32", "bfloat16", "float16")
_logged: set = set()


def kernel_problems(impl: str, *, head_dim: int, page_size: int, pages_per_seq: int, dtype,
                    num_heads: int | None = None, num_kv_heads: int | None = None) -> list[str]:
    """The documented constraints of kernel `impl` that these shapes break; [] when it can take them.

    pallas_tpu (Mosaic): head_dim a multiple of 128 (lanes), page_size a multiple of 8 rows of 32 bits (16 in
    bf16), pages float32 or bfloat16. pallas_gpu (Triton): head_dim and page_size * gcd(pages_per_seq, 8) (the keys
    of one compute block) powers of two >= 16, pages float32, bfloat16 or float16. Both: num_heads a multiple of
    num_kv_heads (checked when given)."""
    if impl not in ("pallas_tpu", "pallas_gpu"):
        return []
    dtype = jnp.dtype(dtype)
    out = []
    if num_heads is not None and num_kv_heads and num_heads % num_kv_heads:
        out.append(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if impl == "pallas_tpu":
        rows = 16 if dtype.name == "bfloat16" else 8
        if head_dim % 128:
            out.append(f"head_dim={head_dim} is not a multiple of 128 (TPU lanes)")
        if page_size % rows:
            out.append(f"page_size={page_size} is not a multiple of {rows} (TPU sublanes in {dtype.name})")
        if dtype.name not in _FLOATS[:2]:
            out.append(f"dtype={dtype.name} is not float32 or bfloat16")
    elif impl == "pallas_gpu":
        block = page_size * math.gcd(pages_per_seq, 8)
        if head_dim < 16 or head_dim & (head_dim - 1):
            out.append(f"head_dim={head_dim} is not a power of two >= 16 (Triton)")
        if block < 16 or block & (block - 1):
            out.append(f"page_size={page_size} * gcd(pages_per_seq={pages_per_seq}, 8) = {block} keys per block "
                       "is not a power of two >= 16 (Triton)")
        if dtype.name not in _FLOATS:
            out.append(f"dtype={dtype.name} is not one of {_FLOATS}")
    return out


def resolve_impl(impl: str, platform: str | None = None, **shapes) -> str:
    """The implementation `impl` runs as: "auto" is the platform's kernel where `shapes` allow, else "reference".

    shapes: `kernel_problems`' keywords (none: nothing checked). Raises ValueError for a name not in IMPLS, or a
    kernel named explicitly that cannot take the shapes."""
    if impl not in IMPLS:
        raise ValueError(f"paged attention impl={impl!r}; expected one of {IMPLS}")
    if impl == "reference":
        return impl
    kernel = impl if impl != "auto" else _KERNEL_OF.get(platform or jax.default_backend(), "reference")
    problems = kernel_problems(kernel, **shapes) if shapes and kernel != "reference" else []
    if problems and impl != "auto":
        raise ValueError(f"paged attention impl={impl!r} cannot take these shapes: {'; '.join(problems)}")
    if problems:
        reason = f"paged attention: auto uses the reference, not {kernel}: {'; '.join(problems)}"
        if reason not in _logged:
            _logged.add(reason)
            logging.getLogger(__name__).warning(reason)
        return "reference"
    return kernel


def _shapes(q_SxNxH, pages_KxPxZxH, page_table_SxM) -> dict:
    K, _, Z, H = pages_KxPxZxH.shape
    return {"head_dim": H, "page_size": Z, "pages_per_seq": page_table_SxM.shape[1], "dtype": pages_KxPxZxH.dtype,
            "num_heads": q_SxNxH.shape[-2], "num_kv_heads": K}


def _dense_chunk_attention(q_SxQxNxH, k_KxSxTxH, v_KxSxTxH, keep_SxQxT, scale):
    """Masked softmax attention of Q query tokens per sequence over T gathered keys: [S, Q, N, H] in q's dtype."""
    S, Q, N, H = q_SxQxNxH.shape
    K = k_KxSxTxH.shape[0]
    q = q_SxQxNxH.reshape(S, Q, K, N // K, H)
    logits = jnp.einsum("sqkgh,ksth->sqkgt", q, k_KxSxTxH.astype(q.dtype), preferred_element_type=jnp.float32)
    logits = logits * scale + jnp.where(keep_SxQxT, 0.0, MASK_VALUE)[:, :, None, None, :]
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("sqkgt,ksth->sqkgh", probs.astype(q.dtype), v_KxSxTxH.astype(q.dtype),
                     preferred_element_type=jnp.float32)
    return out.reshape(S, Q, N, v_KxSxTxH.shape[-1]).astype(q_SxQxNxH.dtype)


def _dense_attention(q_SxNxH, k_KxSxTxH, v_KxSxTxH, keep_SxT, scale):
    """`_dense_chunk_attention` of one query token per sequence: [S, N, H] in q's dtype."""
    return _dense_chunk_attention(q_SxNxH[:, None], k_KxSxTxH, v_KxSxTxH, keep_SxT[:, None], scale)[:, 0]


def _gather(pages_KxPxZxH, page_table_SxM):
    """Each sequence's pages in order: [K, S, M * Z, H]."""
    K, _, Z, H = pages_KxPxZxH.shape
    S, M = page_table_SxM.shape
    return pages_KxPxZxH[:, page_table_SxM].reshape(K, S, M * Z, H)


def reference_paged_attention(q_SxNxH, k_pages_KxPxZxH, v_pages_KxPxZxH, page_table_SxM, lengths_S, scale):
    """The gather-based reference: [S, N, H] in q's dtype (softmax in float32, masked keys at MASK_VALUE)."""
    k, v = _gather(k_pages_KxPxZxH, page_table_SxM), _gather(v_pages_KxPxZxH, page_table_SxM)
    keep = jnp.arange(k.shape[2])[None, :] < lengths_S[:, None]
    return _dense_attention(q_SxNxH, k, v, keep, scale)


def shared_prefix_attention(q_SxNxH, k_pages_KxPxZxH, v_pages_KxPxZxH, prefix_table_BxF, prefix_len_B, table_SxM,
                            lengths_S, scale):
    """The reference's attention for B blocks of G rows sharing their first pages: [S, N, H] in q's dtype.

    Each block's prefix_len_B[b] shared tokens (a multiple of Z) are gathered once for its G queries (cascade
    attention: Hydragen, arXiv:2402.05099); row s then attends the first lengths_S[s] tokens of its pages table_SxM[s].
    """
    S, N, H = q_SxNxH.shape
    B, K = prefix_table_BxF.shape[0], k_pages_KxPxZxH.shape[0]
    G = S // B
    kp, vp = _gather(k_pages_KxPxZxH, prefix_table_BxF), _gather(v_pages_KxPxZxH, prefix_table_BxF)  # [K, B, F*Z, H]
    ko, vo = (_gather(x, table_SxM).reshape(K, B, G, -1, x.shape[-1]) for x in (k_pages_KxPxZxH, v_pages_KxPxZxH))
    q = q_SxNxH.reshape(B, G, K, N // K, H)
    f32 = dict(preferred_element_type=jnp.float32)
    keep_p = jnp.arange(kp.shape[2])[None, :] < prefix_len_B[:, None]  # [B, F*Z]
    keep_o = (jnp.arange(ko.shape[3])[None, :] < lengths_S[:, None]).reshape(B, G, -1)
    logits = jnp.concatenate([
        jnp.einsum("bgkrh,kbth->bgkrt", q, kp.astype(q.dtype), **f32) * scale
        + jnp.where(keep_p, 0.0, MASK_VALUE)[:, None, None, None, :],
        jnp.einsum("bgkrh,kbgth->bgkrt", q, ko.astype(q.dtype), **f32) * scale
        + jnp.where(keep_o, 0.0, MASK_VALUE)[:, :, None, None, :]], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    T = kp.shape[2]
    out = (jnp.einsum("bgkrt,kbth->bgkrh", probs[..., :T], vp.astype(q.dtype), **f32)
           + jnp.einsum("bgkrt,kbgth->bgkrh", probs[..., T:], vo.astype(q.dtype), **f32))
    return out.reshape(S, N, vp.shape[-1]).astype(q_SxNxH.dtype)


def _pallas_tpu(q, k_pages, v_pages, page_table, lengths, interpret: bool):
    from jax.experimental import pallas as pl  # noqa: F401  (imported for its registration side effects)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    M = page_table.shape[1]
    block = math.gcd(M, 8)  # pages per compute block: must divide the pages per sequence
    scope = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with scope:
        return paged_attention(q, k_pages, v_pages, lengths, page_table, mask_value=MASK_VALUE,
                               pages_per_compute_block=block)


def _pallas_gpu(q, k_pages, v_pages, page_table, lengths, interpret: bool):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    M = page_table.shape[1]
    return paged_attention(q, k_pages, v_pages, page_table, lengths, mask_value=MASK_VALUE,
                           pages_per_compute_block=math.gcd(M, 8), k_splits=1, interpret=interpret)


def paged_attention(q_SxNxH, k_pages_KxPxZxH, v_pages_KxPxZxH, page_table_SxM, lengths_S, *, scale: float,
                    impl: str = "auto", interpret: bool = False):
    """softmax(scale * q k^T) v of each sequence's one query token over its first `lengths_S` cached tokens.

    Args:
      q_SxNxH: queries (float dtype); query head n reads kv head n // (N / K).
      k_pages_KxPxZxH, v_pages_KxPxZxH: the page pool of one layer (same shape; the compute dtype).
      page_table_SxM: int32 page ids (entries past a sequence's length are never read, but must be in [0, P)).
      lengths_S: int32 tokens attended per sequence, in [1, M * Z].
      scale: logit multiplier (1/sqrt(H), or MLA's scale).
      impl: one of IMPLS ("auto": by `jax.default_backend()`); interpret: run a Pallas kernel interpreted.
    Returns:
      [S, N, H] in q's dtype.
    Raises:
      ValueError: unknown impl, a named kernel that cannot take the shapes (`kernel_problems`), N not a
        multiple of K, or k/v pages of different shapes.
    """
    N, K = q_SxNxH.shape[1], k_pages_KxPxZxH.shape[0]
    if N % K or k_pages_KxPxZxH.shape != v_pages_KxPxZxH.shape:
        raise ValueError(f"paged attention: {N} query heads over {K} kv heads, k pages {k_pages_KxPxZxH.shape}, "
                         f"v pages {v_pages_KxPxZxH.shape} (need N % K == 0 and equal page shapes)")
    impl = resolve_impl(impl, **_shapes(q_SxNxH, k_pages_KxPxZxH, page_table_SxM))
    lengths_S = lengths_S.astype(jnp.int32)
    page_table_SxM = page_table_SxM.astype(jnp.int32)
    if impl == "reference":
        return reference_paged_attention(q_SxNxH, k_pages_KxPxZxH, v_pages_KxPxZxH, page_table_SxM, lengths_S,
                                         scale)
    kernel = _pallas_tpu if impl == "pallas_tpu" else _pallas_gpu
    q = (q_SxNxH.astype(jnp.float32) * scale).astype(k_pages_KxPxZxH.dtype)
    out = kernel(q, k_pages_KxPxZxH, v_pages_KxPxZxH, page_table_SxM, lengths_S, interpret)
    return out.astype(q_SxNxH.dtype)


def write_tokens(pages: dict, entries: dict, page_S: jax.Array, offset_S: jax.Array, impl: str = "reference",
                 interpret: bool = False) -> dict:
    """pages with S token entries written at (page_S, offset_S); tokens sharing a target in an unspecified order.

    pages {"k", "v": [..., K, P, Z, H]} or {"kv": [..., 1, P, Z, C]}, entries {"k", "v": [..., S, K, H]} or {"kv":
    [..., S, C]}. impl "pallas_tpu" on pages without leading axes writes with `page_writes`, else an XLA scatter."""
    out = {}
    for name, pool in pages.items():
        e = entries[name] if name != "kv" else entries[name][..., None, :]  # [..., S, K, H]
        if impl == "pallas_tpu" and pool.ndim == 4:

            out[name] = write_rows_pallas_tpu(pool, e, page_S, offset_S, interpret=interpret)
        else:
            out[name] = pool.at[..., page_S, offset_S, :].set(jnp.moveaxis(e, -3, -2).astype(pool.dtype))
    return out


def _kv(pages: dict):
    """(keys, values) of one layer's pages: GQA "k", "v", or MLA's "kv" serving as both."""
    return (pages["kv"], pages["kv"]) if "kv" in pages else (pages["k"], pages["v"])


def attend_pages(pages: dict, q_SxNxH, page_table_SxM, lengths_S, scale: float, impl: str = "auto",
                 interpret: bool = False):
    """`paged_attention` over one layer's pages, GQA {"k", "v"} or MLA {"kv"}: [S, N, H or C]."""
    k, v = _kv(pages)
    return paged_attention(q_SxNxH, k, v, page_table_SxM, lengths_S, scale=scale, impl=impl, interpret=interpret)


def attend_with_new_token(pages: dict, own: dict, q_SxNxH, page_table_SxM, lengths_S, page_S, offset_S,
                          scale: float, impl: str = "auto", interpret: bool = False, shared=None):
    """Writes each sequence's entry `own` at (page_S, offset_S), attends its first lengths_S + 1 tokens: (out, pages).

    Pass the whole pool (`flat_pages`), not a slice: the write then updates it in place instead of copying the
    slice. shared: as `engine.ops.decode_chunk`'s (`shared_prefix_attention`)."""
    pages = write_tokens(pages, own, page_S, offset_S, impl, interpret)
    if shared is not None:
        k, v = _kv(pages)
        return shared_prefix_attention(q_SxNxH, k, v, shared[0], shared[1], page_table_SxM, lengths_S + 1,
                                       scale), pages
    return attend_pages(pages, q_SxNxH, page_table_SxM, lengths_S + 1, scale, impl, interpret), pages


def flat_pages(pool_stack: dict) -> dict:
    """A stack's pool [K, L, P, Z, H] viewed as one layer's pages [K, L * P, Z, H]: page p of layer l is `l * P + p`."""
    return {n: x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:]) for n, x in pool_stack.items()}


def stacked_pages(flat: dict, num_layers: int) -> dict:
    """The inverse of `flat_pages`: [K, L * P, Z, H] -> [K, L, P, Z, H]."""
    return {n: x.reshape(x.shape[0], num_layers, x.shape[1] // num_layers, *x.shape[2:]) for n, x in flat.items()}


def write_layers(pool_stack: dict, entries: dict, page_S, offset_S) -> dict:
    """`pool_stack` [K, L, P, Z, H] with every layer's entries {"k", "v": [L, S, K, H]} or {"kv": [L, S, C]} written."""
    L, P = next(iter(pool_stack.values())).shape[1:3]
    pages = (jnp.arange(L)[:, None] * P + page_S[None, :]).reshape(-1)
    offsets = jnp.broadcast_to(offset_S[None, :], (L, offset_S.shape[0])).reshape(-1)
    flat = write_tokens(flat_pages(pool_stack), {n: e.reshape(-1, *e.shape[2:]) for n, e in entries.items()},
                        pages, offsets)
    return stacked_pages(flat, L)


def attend_chunk(pages: dict, own: dict, q_BxQxNxH, page_table_BxM, start_B, scale: float):
    """Attention of Q new tokens (entries `own`) per sequence over its first `start_B` tokens and, causally, each other.

    Reference only. Returns [B, Q, N, H or C] in q's dtype."""
    k, v = (_gather(x, page_table_BxM.astype(jnp.int32)) for x in _kv(pages))  # [K, B, M * Z, H]
    own_k, own_v = (own["kv"][:, :, None], own["kv"][:, :, None]) if "kv" in own else (own["k"], own["v"])
    k = jnp.concatenate([k, jnp.transpose(own_k, (2, 0, 1, 3)).astype(k.dtype)], axis=2)
    v = jnp.concatenate([v, jnp.transpose(own_v, (2, 0, 1, 3)).astype(v.dtype)], axis=2)
    B, Q, T = q_BxQxNxH.shape[0], q_BxQxNxH.shape[1], k.shape[2] - q_BxQxNxH.shape[1]
    cached = jnp.broadcast_to(jnp.arange(T)[None, None, :] < start_B[:, None, None], (B, Q, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((Q, Q), bool))[None], (B, Q, Q))
    return _dense_chunk_attention(q_BxQxNxH, k, v, jnp.concatenate([cached, causal], axis=-1), scale)
