"""Blockwise (FlashAttention-2-style) self-attention equals the dense multi-source softmax in values and gradients
(GQA and MLA shapes, packed rows with branch masks, lengths not a multiple of the block, a one-token completion),
skips fully masked blocks, keeps memory linear in the row length, and is what the model runs on long rows.

Comparisons are restricted to queries with at least one allowed key: the dense path gives padding queries a
uniform average of all values, the blockwise one gives 0 (neither reaches a loss).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.model import blockwise_attention as blockwise_attention_lib
from posttrain.model.attention import Source, gqa_combine, gqa_logits, multi_source_attention
from posttrain.model.blockwise_attention import RowIds, block_mask, blockwise_attention, live_blocks, self_mask
from helpers import random_model

T = 45  # not a multiple of any block used below


def packed_ids(T=T):
    """segment, branch [2, T]. Row 0: two prompts, the first with completions of 5, 1 (a one-token completion)
    and 7 tokens, the second with one of 10; then 5 padding tokens. Row 1: one prompt, 3 completions, no pad."""
    seg, br = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    seg[0, :20], br[0, 7:12], br[0, 12], br[0, 13:20] = 1, 1, 2, 3
    seg[0, 20:40], br[0, 30:40] = 2, 1
    seg[1], br[1, 10:25], br[1, 25:38], br[1, 38:] = 1, 1, 2, 3
    return jnp.asarray(seg), jnp.asarray(br)


def dense(q, k, v, mask, scale):
    return multi_source_attention(q, [Source({"k": k, "v": v}, mask)], scale, gqa_logits, gqa_combine)


def values_and_grads(fn, q, k, v, valid_BxT, w):
    """fn's output and the gradients of sum(w * out) over queries with an allowed key, wrt q, k, v (one jit)."""
    mask = lambda x: jnp.where(valid_BxT[..., None, None], x.astype(jnp.float32), 0.0)
    out, vjp = jax.vjp(lambda *a: mask(fn(*a)), q, k, v)
    return [out, *vjp(w)]


SHAPES = {"gqa": (4, 2, 16, 16), "mla": (4, 4, 24, 16)}  # N, K, H, E (MLA expanded: K = N, E != H)


def compare(kind, dtype, block_q, block_k, seed=0):
    N, K, H, E = SHAPES[kind]
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T) + s), dtype) for s in ((N, H), (K, H), (K, E)))
    w = jnp.asarray(rng.standard_normal((2, T, N, E)), jnp.float32)
    seg, br = packed_ids()
    mask = self_mask(seg, br, blockwise=False)
    valid = mask.any(-1)
    scale = H ** -0.5
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    ref = jax.jit(values_and_grads, static_argnums=0)(lambda *a: dense(*a, mask, scale), q, k, v, valid, w)
    blockwise = lambda *a: blockwise_attention(*a, RowIds(seg, br), scale, precision=prec, block_q=block_q,
                                               block_k=block_k)
    got = jax.jit(values_and_grads, static_argnums=0)(blockwise, q, k, v, valid, w)
    return ref, got


@pytest.mark.parametrize("kind,block_q,block_k", [("gqa", 16, 8), ("mla", 8, 16)])
def test_blockwise_equals_dense_f32(kind, block_q, block_k):
    ref, got = compare(kind, jnp.float32, block_q, block_k)
    for name, r, g in zip(("out", "dq", "dk", "dv"), ref, got):
        assert float(jnp.abs(r).max()) > 0.1, name  # something to compare
        err = float(jnp.abs(r - g).max())
        assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_blockwise_equals_dense_bf16(kind):
    ref, got = compare(kind, jnp.bfloat16, 16, 16, seed=1)
    for name, r, g in zip(("out", "dq", "dk", "dv"), ref, got):
        r, g = r.astype(jnp.float32), g.astype(jnp.float32)
        rel = float(jnp.linalg.norm(r - g) / jnp.linalg.norm(r))
        assert rel <= 2e-2, (name, rel)


def test_fully_masked_blocks_are_skipped():
    # live_blocks is conservative (every block holding an allowed pair is live) and skips causal and cross-branch
    # blocks: brute force over the [T, T] mask here.
    seg, br = packed_ids(64)
    seg = seg.at[1, 56:].set(0)  # both rows end in padding: key block 7 (8 wide) is empty
    m = np.asarray(self_mask(seg, br, blockwise=False))
    blocks = lambda a, L: jnp.moveaxis(a.reshape(2, -1, L), 1, 0)
    live = np.asarray(live_blocks(blocks(seg, 8), blocks(br, 8), blocks(seg, 8), blocks(br, 8)))
    has_pair = m.reshape(2, 8, 8, 8, 8).any(axis=(0, 2, 4))
    assert (live >= has_pair).all()
    assert not live[np.triu_indices(8, 1)].any() and not live[:, 7].any()
    assert live.sum() < np.tril(np.ones((8, 8))).sum() - 8  # more than the causal half and the pad column skipped
    # A skipped block is never read: NaN keys/values there leave every output and gradient finite and unchanged.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 64, 2, 8)), jnp.float32) for _ in range(3))
    poison = lambda x: x.at[:, 56:].set(jnp.nan)
    fn = lambda q, k, v: blockwise_attention(q, k, v, RowIds(seg, br), 0.3, block_q=8, block_k=8)
    valid, w = jnp.asarray(m.any(-1)), jnp.ones((2, 64, 2, 8))
    run = jax.jit(values_and_grads, static_argnums=0)
    clean, dirty = run(fn, q, k, v, valid, w), run(fn, q, poison(k), poison(v), valid, w)
    for c, d in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(c)[:, :56], np.asarray(d)[:, :56])
    assert np.isfinite(np.asarray(dirty[0])).all()


def test_backward_memory_is_linear_in_row_length():
    """Compiled temp memory of the gradient of two layers at T=2048, block 128, is far below one dense [T, T] f32
    score tensor per head (the dense path needs several). The layers are a scan with the ids loop-invariant, like
    the model's: JAX's partial evaluation there once hoisted every id-only value out of the loop, stacked over
    all block pairs."""
    B, T, N, H = 1, 2048, 2, 16
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    ids = RowIds(jnp.ones((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))
    attn = lambda q, k, v: blockwise_attention(q, k, v, ids, 0.25, block_q=128, block_k=128)

    def layers(q, k, v):
        return jax.lax.scan(lambda h, _: (h + attn(h, k * h, v), None), q, None, length=2)[0]

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(layers(*a) ** 2), (0, 1, 2)))
    temp = grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
    scores = B * N * T * T * 4  # 32 MiB
    assert temp < scores / 4, (temp, scores)  # id-only values hoisted out of the scan would take ~3x `scores`


def test_bad_input_raises():
    q = jnp.zeros((1, 8, 3, 4))
    ids = RowIds(jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="multiple of K"):
        blockwise_attention(q, jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4)), ids, 1.0)
    with pytest.raises(ValueError, match="block_q=0"):
        blockwise_attention(q, jnp.zeros((1, 8, 3, 4)), jnp.zeros((1, 8, 3, 4)), ids, 1.0, block_q=0, block_k=8)
    with pytest.raises(ValueError, match="one source"):
        blockwise_attention_lib.attend(q, {"k": q, "v": q}, ids, 1.0, None, [Source({"k": q, "v": q}, jnp.ones((1, 8, 8), bool))])


def test_path_chosen_by_row_length():
    seg, br = jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32)
    assert isinstance(self_mask(seg, br), jax.Array)  # short row: dense [B, T, T] mask
    long_seg = jnp.ones((1, blockwise_attention_lib.BLOCKWISE_MIN_LEN), jnp.int32)
    assert isinstance(self_mask(long_seg, jnp.zeros_like(long_seg)), RowIds)
    idx = jnp.arange(4)
    np.testing.assert_array_equal(np.asarray(self_mask(seg, br)), np.asarray(block_mask(seg, br, idx, seg, br, idx)))


@pytest.mark.parametrize("preset,grads", [("tiny-qwen3", True), ("tiny-deepseek", False),
                                          pytest.param("tiny-deepseek", True, marks=pytest.mark.slow)])
def test_model_blockwise_equals_dense(preset, grads, monkeypatch):
    """hidden_states(blockwise=True) vs False: values and (GQA; MLA in the slow run) parameter gradients, several
    blocks per row, one dense layer (compile time). MLA's own gradients are covered at the function level."""
    monkeypatch.setattr(blockwise_attention_lib, "default_block", lambda: 16)
    cfg, graphdef, state = random_model(preset, num_layers=1, moe=None)
    seg, br = packed_ids()
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)), jnp.int32)
    valid = (seg != 0)[..., None]

    def loss(state, blockwise):
        h, _ = nnx.merge(graphdef, state).hidden_states(tok, pos, seg, br, blockwise=blockwise)
        h = jnp.where(valid, h, 0.0)
        return jnp.sum(h ** 2), h

    run = jax.jit(jax.value_and_grad(loss, has_aux=True) if grads else loss, static_argnums=1)
    (_, h_ref), g_ref = run(state, False) if grads else (run(state, False), None)
    (_, h_got), g_got = run(state, True) if grads else (run(state, True), None)
    np.testing.assert_allclose(np.asarray(h_got), np.asarray(h_ref), rtol=0, atol=1e-5 * float(jnp.abs(h_ref).max()))
    for r, g in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * float(jnp.abs(r).max()) + 1e-7)


def test_model_precision_reaches_blockwise_backward():
    """Under JAX's DEFAULT, the model's matmul_precision="highest" reaches every dot of the blockwise forward and
    of its hand-written backward (traced outside the model's precision scope)."""
    cfg, graphdef, state = random_model("tiny-qwen3", num_layers=1, matmul_precision="highest")
    seg, br = packed_ids()
    tok = jnp.zeros((2, T), jnp.int32)

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state).hidden_states(tok, None, seg, br, blockwise=True)[0] ** 2)

    with jax.default_matmul_precision("default"):
        hlo = jax.jit(jax.grad(loss)).lower(state).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", hlo)
    flash_dots = [d for d in dots if "tensor<2x2x2x" in d]  # [B, K, G, ...] block operands
    assert len(flash_dots) >= 7, len(flash_dots)  # 2 forward (+ 2 recomputed under remat), 5 backward
    assert all("HIGHEST" in d for d in dots), [d for d in dots if "HIGHEST" not in d][:2]

