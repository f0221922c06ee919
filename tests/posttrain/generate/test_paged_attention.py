"""Paged attention (docs/design.md invariant 13): the gather reference equals a NumPy dense attention on ragged page
tables, page boundaries and one-token sequences (f32 <= 1e-5); the Pallas kernels, interpreted on the CPU, equal
the reference (GPU kernel <= 1e-5; the TPU kernel's dots take the TPU default precision, bf16 passes, which its
interpreter emulates: equal within bf16 rounding); page writes land where the page table says and nowhere else.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.generate import paged_attention

Z, M, P = 4, 4, 20  # tokens per page, pages per sequence, pages in the pool
LENGTHS = [1, Z, Z + 1, M * Z, 3, 2 * Z - 1]  # one token, exactly one page, a page boundary, full table, ragged


def _case(K, N, H, seed=0, z=Z):
    rng = np.random.default_rng(seed)
    lengths = [1, z, z + 1, M * z, 3, 2 * z - 1]  # LENGTHS at page size z
    S = len(lengths)
    q = rng.normal(size=(S, N, H)).astype(np.float32)
    k = rng.normal(size=(K, P, z, H)).astype(np.float32)
    v = rng.normal(size=(K, P, z, H)).astype(np.float32)
    table = np.zeros((S, M), np.int32)  # ragged: each sequence holds only the pages it needs, in shuffled order
    free = list(rng.permutation(np.arange(1, P)))
    for s, n in enumerate(lengths):
        for j in range(-(-n // z)):
            table[s, j] = free.pop()
    return q, k, v, table, np.asarray(lengths, np.int32)


def _numpy_attention(q, k, v, table, lengths, scale):
    """Dense attention of each sequence over its first `length` tokens, read page by page (float64)."""
    S, N, H = q.shape
    K = k.shape[0]
    out = np.zeros((S, N, v.shape[-1]))
    for s in range(S):
        n = lengths[s]
        ks = np.stack([k[:, table[s, i // Z], i % Z] for i in range(n)], 1)  # [K, n, H]
        vs = np.stack([v[:, table[s, i // Z], i % Z] for i in range(n)], 1)
        for h in range(N):
            kv = h // (N // K)
            lg = ks[kv].astype(np.float64) @ q[s, h] * scale
            p = np.exp(lg - lg.max())
            out[s, h] = (p / p.sum()) @ vs[kv]
    return out


@pytest.mark.parametrize("K,N,H", [(2, 4, 16), (1, 4, 24)], ids=["gqa", "one-kv-head-mla"])
def test_reference_equals_dense_attention(K, N, H):
    q, k, v, table, lengths = _case(K, N, H)
    if K == 1:  # MLA: the values are the same pages as the keys
        v = k
    got = paged_attention.paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table),
                             jnp.asarray(lengths), scale=H ** -0.5, impl="reference")
    np.testing.assert_allclose(np.asarray(got), _numpy_attention(q, k, v, table, lengths, H ** -0.5), atol=1e-5)
    assert got.dtype == jnp.float32 and got.shape == (len(LENGTHS), N, H)


@pytest.mark.parametrize("impl,atol,H,z", [("pallas_gpu", 1e-5, 16, 4), ("pallas_tpu", 3e-2, 128, 8)])
def test_kernels_interpreted_equal_reference(impl, atol, H, z):
    """The kernels in the Pallas interpreter on the CPU, at shapes each takes on its hardware (`kernel_problems`).
    TPU: its einsums run at the TPU default precision (bf16 operand passes: a length-1 row returns v rounded to
    bf16), so the bound is bf16 rounding, not 1e-5."""
    q, k, v, table, lengths = (jnp.asarray(a) for a in _case(2, 4, H, seed=1, z=z))
    ref = paged_attention.paged_attention(q, k, v, table, lengths, scale=0.25, impl="reference")
    got = paged_attention.paged_attention(q, k, v, table, lengths, scale=0.25, impl=impl, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=atol)


# (head_dim, page_size, pages_per_seq, dtype, num_heads, num_kv_heads) -> the constraints each kernel finds broken
KERNEL_TABLE = [
    ((64, 16, 32, "bfloat16", 9, 3), ["head_dim=64"], []),  # SmolLM2-135M: the TPU kernel refuses head dim 64
    ((128, 16, 32, "bfloat16", 16, 8), [], []),  # qwen3-0.6b
    ((576, 16, 32, "bfloat16", 16, 1), ["head_dim=576"], ["head_dim=576"]),  # DeepSeek MLA's 512 + 64 entry
    ((128, 8, 32, "bfloat16", 8, 8), ["page_size=8 is not a multiple of 16"], []),  # bf16 packs 16 rows
    ((128, 8, 32, "float32", 8, 8), [], []),
    ((16, 4, 10, "float32", 4, 2), ["head_dim=16", "page_size=4"], ["= 8 keys per block"]),  # tiny, gcd(10, 8) = 2
    ((128, 16, 8, "int8", 8, 8), ["dtype=int8"], ["dtype=int8"]),
    ((128, 16, 8, "float16", 6, 4), ["num_heads=6", "dtype=float16"], ["num_heads=6"]),
    ((48, 16, 8, "float32", 4, 4), ["head_dim=48"], ["head_dim=48 is not a power of two"]),
]


@pytest.mark.parametrize("shape,tpu,gpu", KERNEL_TABLE)
def test_auto_picks_a_kernel_only_where_its_constraints_hold(shape, tpu, gpu, caplog):
    """Constraint check only (nothing runs): "auto" takes the platform's kernel iff `kernel_problems` is empty,
    else the reference with one log line per reason; the kernel asked for by name raises naming the constraint."""
    H, Zs, Ms, dtype, N, K = shape
    kw = dict(head_dim=H, page_size=Zs, pages_per_seq=Ms, dtype=dtype, num_heads=N, num_kv_heads=K)
    for impl, platform, want in (("pallas_tpu", "tpu", tpu), ("pallas_gpu", "gpu", gpu)):
        problems = paged_attention.kernel_problems(impl, **kw)
        assert len(problems) == len(want) and all(w in p for w, p in zip(want, problems)), (impl, problems)
        caplog.clear()
        got = [paged_attention.resolve_impl("auto", platform, **kw) for _ in range(2)]
        assert got == [impl if not want else "reference"] * 2
        assert len(caplog.records) <= 1 and (not want or paged_attention._logged)  # logged once per reason at most
        if want:
            with pytest.raises(ValueError, match=f"impl='{impl}' cannot take these shapes: .*{want[0]}"):
                paged_attention.resolve_impl(impl, platform, **kw)
        else:
            assert paged_attention.resolve_impl(impl, platform, **kw) == impl
    assert paged_attention.kernel_problems("reference", **kw) == [] and paged_attention.resolve_impl("auto", "cpu", **kw) == "reference"


def test_write_tokens_and_attend_pages_layouts():
    """write_tokens puts token s's entry at (page_S[s], offset_S[s]) of every leading axis and leaves the rest of
    the pool as it was; attend_pages reads MLA's single "kv" entry as keys and values."""
    rng = np.random.default_rng(2)
    L, K, H, C, S = 2, 2, 8, 6, 3
    pool = {"k": jnp.asarray(rng.normal(size=(L, K, P, Z, H)), jnp.float32),
            "v": jnp.asarray(rng.normal(size=(L, K, P, Z, H)), jnp.float32)}
    new = {n: jnp.asarray(rng.normal(size=(L, S, K, H)), jnp.float32) for n in ("k", "v")}
    page, off = np.asarray([5, 9, 5]), np.asarray([0, 3, 2])
    out = jax.jit(paged_attention.write_tokens)(pool, new, jnp.asarray(page), jnp.asarray(off))
    for n in ("k", "v"):
        want = np.asarray(pool[n]).copy()
        for s in range(S):
            want[:, :, page[s], off[s]] = np.asarray(new[n])[:, s]
        np.testing.assert_array_equal(np.asarray(out[n]), want)
    mla = {"kv": jnp.asarray(rng.normal(size=(1, P, Z, C)), jnp.float32)}
    mla = paged_attention.write_tokens(mla, {"kv": jnp.ones((S, C))}, jnp.asarray(page), jnp.asarray(off))
    np.testing.assert_array_equal(np.asarray(mla["kv"])[0, 9, 3], np.ones(C))
    q = jnp.asarray(rng.normal(size=(S, 4, C)), jnp.float32)
    table = jnp.asarray([[5, 1], [2, 9], [5, 3]], jnp.int32)
    got = paged_attention.attend_pages(mla, q, table, jnp.asarray([1, 8, 3], jnp.int32), 0.5, impl="reference")
    kv = np.asarray(mla["kv"])
    want = _numpy_attention(np.asarray(q), kv, kv, np.asarray(table), [1, 8, 3], 0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu"])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_new_token_is_written_into_the_whole_pool_and_attended_at_its_layer(mla, impl):
    """The decode step's attention on a 3-layer pool read as one layer of 3 * P pages (`flat_pages`): layer l's
    page ids are offset by l * P; the new token's entry lands at its page and offset of that layer only, and
    attention over length + 1 tokens equals NumPy's over the layer's pages (lengths 0 included)."""
    rng = np.random.default_rng(3)
    L, S, N, H, layer = 3, 3, 4, 16, 1
    names, K = (("kv",), 1) if mla else (("k", "v"), 2)
    stacked = {n: jnp.asarray(rng.normal(size=(K, L, P, Z, H)), jnp.float32) for n in names}
    own = {n: jnp.asarray(rng.normal(size=(S, H) if mla else (S, K, H)), jnp.float32) for n in names}
    table = jnp.asarray([[3, 4, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 15, 0], jnp.int32)
    page, off = table[jnp.arange(S), lengths // Z], lengths % Z
    q = jnp.asarray(rng.normal(size=(S, N, H)), jnp.float32)
    out, flat = jax.jit(lambda pages, own, q: paged_attention.attend_with_new_token(
        paged_attention.flat_pages(pages), own, q, table + layer * P, lengths, page + layer * P, off, 0.3, impl=impl,
        interpret=impl != "reference"))(stacked, own, q)
    written = paged_attention.stacked_pages(flat, L)
    want_pages = {n: np.array(x) for n, x in stacked.items()}
    for n in names:
        e = np.asarray(own[n]) if not mla else np.asarray(own[n])[:, None]
        for s in range(S):
            want_pages[n][:, layer, int(page[s]), int(off[s])] = e[s]
        np.testing.assert_array_equal(np.asarray(written[n]), want_pages[n])  # the other layers untouched
    k = want_pages[names[0]][:, layer]
    want = _numpy_attention(np.asarray(q), k, want_pages[names[-1]][:, layer], np.asarray(table),
                            np.asarray(lengths) + 1, 0.3)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_write_layers_puts_each_layer_entry_at_its_page(mla):
    """A prefill's entries of every layer ([L, S, ...]) go to (layer, page_S[s], offset_S[s]) of the stacked pool."""
    rng = np.random.default_rng(4)
    L, S, H = 3, 5, 8
    names, K = (("kv",), 1) if mla else (("k", "v"), 2)
    pool = {n: jnp.asarray(rng.normal(size=(K, L, P, Z, H)), jnp.float32) for n in names}
    entries = {n: jnp.asarray(rng.normal(size=(L, S, H) if mla else (L, S, K, H)), jnp.float32) for n in names}
    page, off = np.asarray([2, 2, 3, 19, 0]), np.asarray([0, 1, 3, 2, 1])
    got = jax.jit(paged_attention.write_layers)(pool, entries, jnp.asarray(page), jnp.asarray(off))
    for n in names:
        want = np.array(pool[n])
        e = np.asarray(entries[n]) if not mla else np.asarray(entries[n])[:, :, None]
        for layer in range(L):
            for s in range(S):
                want[:, layer, page[s], off[s]] = e[layer, s]
        np.testing.assert_array_equal(np.asarray(got[n]), want)


def test_resolve_impl_and_bad_input():
    assert [paged_attention.resolve_impl("auto", p) for p in ("cpu", "tpu", "gpu")] == ["reference", "pallas_tpu", "pallas_gpu"]
    assert paged_attention.resolve_impl("reference", "tpu") == "reference"
    with pytest.raises(ValueError, match="impl='splash'"):
        paged_attention.resolve_impl("splash")
    q = jnp.zeros((2, 3, 8))
    pages = jnp.zeros((2, P, Z, 8))
    with pytest.raises(ValueError, match="3 query heads over 2 kv heads"):
        paged_attention.paged_attention(q, pages, pages, jnp.zeros((2, M), jnp.int32), jnp.ones((2,), jnp.int32), scale=1.0)


@pytest.mark.parametrize("K,Z,H,dtype", [(2, 4, 8, jnp.float32), (8, 16, 128, jnp.bfloat16), (1, 8, 24, jnp.float32)],
                         ids=["gqa-f32", "gqa-bf16-tpu-tiles", "mla-kv"])
def test_tpu_page_write_kernel_interpreted_equals_the_scatter(K, Z, H, dtype):
    """`write_tokens(impl="pallas_tpu")` (the in-place Mosaic kernel, `page_writes`, in the Pallas interpreter) equals
    the XLA scatter: each token's row lands at (page, offset), the rest of each page and pool is untouched, also
    when three layers write in turn inside a scan (the decode step's layer scan over a flat pool); inactive slots
    all target scratch page 0, offset 0 (its content is not read)."""
    rng = np.random.default_rng(5)
    L, P_, S = 3, 7, 5
    name = "kv" if K == 1 else "k"
    pool = {name: jnp.asarray(rng.normal(size=(K, L * P_, Z, H)), dtype)}
    new_LxSxKxH = jnp.asarray(rng.normal(size=(L, S, K, H)), dtype)
    entries = (lambda l: {name: new_LxSxKxH[l][:, 0]}) if K == 1 else (lambda l: {name: new_LxSxKxH[l]})
    page = jnp.asarray([3, 6, 0, 2, 0], jnp.int32)  # slots 2 and 4 inactive: the scratch page
    off = jnp.asarray([Z - 1, 0, 0, Z // 2, 0], jnp.int32)

    def run(impl):
        def body(pages, l):
            return paged_attention.write_tokens(pages, entries(l), page + l * P_, off, impl=impl, interpret=True), None
        return jax.jit(lambda p: jax.lax.scan(body, p, jnp.arange(L))[0])(pool)[name]

    got, want = np.asarray(run("pallas_tpu"), np.float32), np.asarray(run("reference"), np.float32)
    live = np.ones(got.shape[1], bool)
    live[[l * P_ for l in range(L)]] = False  # scratch pages: written by several slots, order unspecified
    np.testing.assert_array_equal(got[:, live], want[:, live])
    for l in range(L):
        np.testing.assert_array_equal(got[:, l * P_ + 3, Z - 1], np.asarray(new_LxSxKxH[l][0], np.float32)[:K])
    untouched = np.asarray(pool[name], np.float32)
    changed = (got != untouched).any(axis=(0, 3))  # [L * P, Z]: one row per live slot and layer, + scratch
    assert changed.sum() == 4 * L and not changed[[l * P_ + p for l in range(L) for p in (1, 4, 5)]].any()


@pytest.mark.parametrize("K,N,H", [(2, 4, 16), (1, 4, 24)], ids=["gqa", "one-kv-head-mla"])
def test_shared_prefix_attention_equals_dense_attention(K, N, H):
    """Blocks of G = 3 rows sharing 0, 1 and 2 leading pages (prefix lengths 0, Z, 2Z), own lengths 0 (only the
    prefix), 1, a page boundary and two pages: equals NumPy dense attention over the concatenated tables (f32 <= 1e-5)
    and the reference over them."""
    rng = np.random.default_rng(3)
    G, shared_pages = 3, [0, 1, 2]
    own_lengths = [[1, Z, 2 * Z], [0, 1, Z + 1], [0, 3, 2 * Z]]
    q = rng.normal(size=(G * len(shared_pages), N, H)).astype(np.float32)
    k = rng.normal(size=(K, P, Z, H)).astype(np.float32)
    v = k if K == 1 else rng.normal(size=(K, P, Z, H)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, P)))
    prefix = np.zeros((len(shared_pages), 2), np.int32)
    own = np.zeros((q.shape[0], 2), np.int32)
    full = np.zeros((q.shape[0], 4), np.int32)
    for b, n in enumerate(shared_pages):
        prefix[b, :n] = [free.pop() for _ in range(n)]
        for g in range(G):
            s = b * G + g
            own[s, :-(-own_lengths[b][g] // Z)] = [free.pop() for _ in range(-(-own_lengths[b][g] // Z))]
            full[s, :n], full[s, n:n + 2] = prefix[b, :n], own[s]
    prefix_len = np.asarray(shared_pages, np.int32) * Z
    lengths = np.asarray([x for row in own_lengths for x in row], np.int32)
    total = np.repeat(prefix_len, G) + lengths
    got = paged_attention.shared_prefix_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(prefix),
                                     jnp.asarray(prefix_len), jnp.asarray(own), jnp.asarray(lengths), H ** -0.5)
    keep = total > 0  # a row attending to nothing is undefined
    want = _numpy_attention(q, k, v, full, total, H ** -0.5)
    np.testing.assert_allclose(np.asarray(got)[keep], want[keep], atol=1e-5)
    ref = paged_attention.paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(full),
                             jnp.asarray(np.maximum(total, 1)), scale=H ** -0.5, impl="reference")
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(ref)[keep], atol=1e-6)
