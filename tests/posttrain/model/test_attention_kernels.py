"""Fused attention paths (TPU splash, Pallas GPU) under the Pallas interpreter vs `flash.blockwise_attention` and the
dense one-softmax attention: values and gradients of q, k, v on packed, branch-masked rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.model import blockwise_attention, attention_kernels
from posttrain.model.config import ModelConfig

pytestmark = pytest.mark.kernel  # scripts/accelerator_check.sh runs these on the accelerator
HIGHEST = jax.lax.Precision.HIGHEST
T = 200  # not a multiple of the kernels' 128 blocks


def packed_ids():
    """Row 0: segment 1 = prompt (20) + completions of 15, 1 (one token) and 24 tokens; segment 2 = prompt (40) +
    completions of 50 and 40; 10 padding tokens. Row 1: one prompt-only segment (120), then padding."""
    seg, br = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    seg[0, :60], br[0, 20:35], br[0, 35], br[0, 36:60] = 1, 1, 2, 3
    seg[0, 60:190], br[0, 100:150], br[0, 150:190] = 2, 1, 2
    seg[1, :120] = 1
    return blockwise_attention.RowIds(jnp.asarray(seg), jnp.asarray(br))


def inputs(N, K, H, E, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                  for s in [(2, T, N, H), (2, T, K, H), (2, T, K, E), (2, T, N, E)])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def value_and_grads(impl, q, k, v, w, ids, scale=0.3):
    """(o [B, T, N, E] float32, (dq, dk, dv) float32) of sum(o * w) through `flash.attend` with `impl`."""
    def loss(q, k, v):
        o = blockwise_attention.attend(q, {"k": k, "v": v}, ids, scale, HIGHEST, impl=impl)
        return (o.astype(jnp.float32) * w).sum(), o

    with jax.default_matmul_precision("highest"):
        (_, o), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return o.astype(jnp.float32), [g.astype(jnp.float32) for g in grads]


def compare(impl, N, K, H, E, dtype):
    """Max abs (f32) or norm-relative (bf16) errors of impl vs blockwise over rows with >= 1 allowed key."""
    ids = packed_ids()
    real = np.asarray(ids.segment_BxT != 0)
    q, k, v, w = inputs(N, K, H, E, dtype)
    w = w * real[:, :, None, None]
    o, grads = value_and_grads(impl, q, k, v, w, ids)
    # reference: float32 blockwise on the same (possibly bf16-rounded) inputs
    o_ref, grads_ref = value_and_grads("blockwise", *(a.astype(jnp.float32) for a in (q, k, v)), w, ids)
    assert np.all(np.asarray(o)[~real] == 0), "padding queries must get 0"
    if dtype == jnp.float32:
        err = lambda a, b: float(jnp.abs(a - b).max())
    else:
        err = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    errs = {"o": err(o[real], o_ref[real])}
    errs.update({n: err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, grads_ref)})
    return errs, (o, grads)


CASES = [("gqa", 4, 2, 16, 16), ("mla", 4, 4, 24, 16)]


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
@pytest.mark.parametrize("name,N,K,H,E", CASES)
def test_fused_matches_blockwise_f32(impl, name, N, K, H, E):
    errs, (o, grads) = compare(impl, N, K, H, E, jnp.float32)
    print(impl, name, "f32 max abs", errs)
    assert max(errs.values()) <= 1e-5, errs
    if name == "gqa":  # the dense one-softmax attention agrees as well (cheap at T = 200)
        ids = packed_ids()
        real = np.asarray(ids.segment_BxT != 0)
        q, k, v, w = inputs(N, K, H, E, jnp.float32)
        o_dense, grads_dense = value_and_grads("dense", q, k, v, w * real[:, :, None, None], ids)
        assert float(jnp.abs(o[real] - o_dense[real]).max()) <= 1e-5
        for a, b in zip(grads, grads_dense):
            assert float(jnp.abs(a - b).max()) <= 1e-5


def test_pallas_gpu_wide_heads_use_smaller_key_blocks():
    """Head dims over 128 (DeepSeek-V3's MLA: 192) run with 64-key forward blocks (`gpu_block_sizes`; 128-key
    blocks exceed an H200's shared memory); still equal to blockwise."""
    sizes = attention_kernels.gpu_block_sizes(attention_kernels._tree_mha_module(), 192)
    assert sizes.block_k == 64 and attention_kernels.gpu_block_sizes(attention_kernels._tree_mha_module(), 128).block_k == 128
    ids = packed_ids()
    real = np.asarray(ids.segment_BxT != 0)
    q, k, v, w = inputs(2, 2, 160, 136, jnp.float32)
    w = w * real[:, :, None, None]
    (o, grads), (o_ref, grads_ref) = (value_and_grads(impl, q, k, v, w, ids, scale=160 ** -0.5)
                                      for impl in ("pallas_gpu", "blockwise"))
    assert float(jnp.abs(o[real] - o_ref[real]).max()) <= 1e-5
    for a, b in zip(grads, grads_ref):
        assert float(jnp.abs(a - b).max()) <= 1e-5


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_fused_matches_blockwise_bf16(impl):
    errs, _ = compare(impl, 4, 2, 16, 16, jnp.bfloat16)
    print(impl, "bf16 relative", errs)
    assert max(errs.values()) <= 2e-2, errs


def test_tree_segment_mask_is_block_mask():
    ids = packed_ids()
    seg, br = ids.segment_BxT[0], ids.branch_BxT[0]
    code = jnp.left_shift(seg, attention_kernels.BRANCH_BITS) | br
    idx = jnp.arange(T)
    expected = blockwise_attention.block_mask(seg[None], br[None], idx, seg[None], br[None], idx)[0]
    got = attention_kernels.tree_segment_mask(code, code) & (idx[:, None] >= idx[None, :])
    assert bool(jnp.all(got == expected))


@pytest.mark.parametrize("platform,H,E,want", [("tpu", 128, 128, "splash"), ("gpu", 128, 128, "pallas_gpu"),
                                               ("cuda", 192, 128, "pallas_gpu"), ("gpu", 512, 128, "blockwise"),
                                               ("cpu", 128, 128, "blockwise")])
def test_resolve_impl_by_platform(platform, H, E, want):
    assert attention_kernels.resolve_impl("auto", platform, H, E) == want
    assert attention_kernels.resolve_impl("dense", platform, H, E) == "dense"


def test_bad_impl_names_raise():
    with pytest.raises(ValueError, match="attention impl='flash3'"):
        attention_kernels.resolve_impl("flash3", "cpu", 16, 16)
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=8,
                    attention_impl="flash3")


def test_platform_without_mesh_is_the_backend():
    assert attention_kernels.mesh_platform() == jax.default_backend()


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from test_attention_kernels import packed_ids, inputs, value_and_grads
from posttrain.infra import mesh as mesh_lib

ids = packed_ids()
q, k, v, w = inputs(4, 2, 16, 16, jnp.float32)
o_ref, g_ref = value_and_grads("blockwise", q, k, v, w, ids)
with jax.set_mesh(mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 1})):
    for impl in ("splash", "pallas_gpu"):
        o, g = value_and_grads(impl, q, k, v, w, ids)
        print(impl, max([float(jnp.abs(o - o_ref).max())] + [float(jnp.abs(a - b).max()) for a, b in zip(g, g_ref)]))
"""


@pytest.mark.slow
def test_fused_under_a_mesh_runs_per_shard():
    """Batch over fsdp (2) and heads over tensor (2) through `fused`'s shard_map: same values and gradients."""
    import os
    import pathlib
    import subprocess
    import sys

    from helpers import fake_devices_flags

    env = dict(os.environ, XLA_FLAGS=fake_devices_flags(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(pathlib.Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    errs = dict(line.split() for line in out.stdout.strip().splitlines())
    assert set(errs) == {"splash", "pallas_gpu"} and all(float(e) <= 1e-5 for e in errs.values()), errs


def test_model_config_selects_the_kernel():
    """ModelConfig.attention_impl reaches the layers: a one-layer tiny-qwen3 forward with the Pallas GPU kernel
    (interpreted) equals the blockwise one, and its program holds the kernel (the blockwise one does not)."""
    from flax import nnx
    from helpers import random_model

    ids = packed_ids()
    real = (ids.segment_BxT != 0)[..., None]
    out, hlo = {}, {}  # hlo: the jaxpr text
    for impl in ("blockwise", "pallas_gpu"):
        cfg, graphdef, state = random_model("tiny-qwen3", num_layers=1, moe=None, attention_impl=impl,
                                            matmul_precision="highest")
        tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)), jnp.int32)
        f = jax.jit(lambda s: nnx.merge(graphdef, s).hidden_states(tok, None, ids.segment_BxT, ids.branch_BxT,
                                                                    blockwise=True)[0])
        out[impl], hlo[impl] = jnp.where(real, f(state), 0.0), str(jax.make_jaxpr(f)(state))
    assert "pallas_call" in hlo["pallas_gpu"] and "pallas_call" not in hlo["blockwise"]
    scale = float(jnp.abs(out["blockwise"]).max())
    assert float(jnp.abs(out["pallas_gpu"] - out["blockwise"]).max()) <= 1e-5 * scale
