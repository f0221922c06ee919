"""The precision policy: config resolution, and every dot of the model, its backward pass (custom VJPs included),
the sampler and the logprobs carrying the requested precision in the lowered HLO."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn.logprobs import score_logprobs
from posttrain.infra import precision
from posttrain.algos.grpo import step
from posttrain.rollout.batching import random_batch
from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer

_DOT = re.compile(r"stablehlo\.(?:dot_general|dot)\b[^\n]*")


def dot_precisions(hlo: str) -> list[str]:
    """One entry per dot in StableHLO text: "HIGHEST", "HIGH" or "DEFAULT" (no precision attribute printed)."""
    out = []
    for line in _DOT.findall(hlo):
        m = re.search(r"precision = \[(?:#stablehlo<precision )?(\w+)", line)
        out.append(m.group(1) if m else "DEFAULT")
    return out


def test_resolve_policy_auto_and_errors():
    assert precision.resolve_policy(backend="cpu") == precision.PrecisionPolicy(param_dtype="float32", compute_dtype="float32")
    for backend in ("gpu", "tpu"):
        assert precision.resolve_policy(backend=backend) == precision.PrecisionPolicy(param_dtype="float32", compute_dtype="bfloat16")
    got = precision.resolve_policy("float32", "bfloat16", "highest", backend="gpu")
    assert (got.compute_dtype, got.param_dtype, got.matmul_precision) == ("float32", "bfloat16", "highest")
    with pytest.raises(ValueError, match="matmul_precision"):
        precision.resolve_policy(matmul_precision="tf32")
    with pytest.raises(ValueError, match="compute_dtype"):
        precision.resolve_policy("fp8")


def _train_grad_hlo(preset: str, matmul_precision: str) -> str:
    cfg = get_preset(preset, matmul_precision=matmul_precision, remat="dots")
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = jax.tree.map(jnp.asarray, random_batch(0, advantage_fn("grpo"), prompts=2, group_size=2, prompt_len=16, completion_len=8,
                                                   vocab_size=cfg.vocab_size))

    def loss(st):
        model = nnx.merge(graphdef, st)
        out, _ = score_logprobs(model, batch, 1.0, 16, with_entropy=True, precision=matmul_precision)
        return out.logp_BxT.sum() + out.entropy_BxT.sum()

    return jax.jit(jax.grad(loss)).lower(state).as_text()


def test_model_policy_sets_every_dot_forward_and_backward(preset="tiny-deepseek"):
    """With JAX's default left at DEFAULT, the model's own "highest" reaches every dot: MLA attention, projections,
    SwiGLU's hand-written backward (its first layer is dense, and it has shared experts), MoE expert matmuls, the
    chunked logprob custom VJP. (The blockwise attention's custom VJP: tests/posttrain/model.)"""
    with jax.default_matmul_precision("default"):
        pinned = dot_precisions(_train_grad_hlo(preset, "highest"))
        free = dot_precisions(_train_grad_hlo(preset, "default"))
    assert len(pinned) >= 20 and set(pinned) == {"HIGHEST"}, sorted(set(pinned))
    assert set(free) == {"DEFAULT"}  # the check can fail: without the policy nothing is pinned


def test_parity_computations_run_at_highest_in_this_suite():
    """The computations the parity tests compare (teacher-forced logits, the sampler's prefill and decode step,
    chunked logprobs) lower with HIGHEST on every dot under the suite's pin (tests/conftest.py)."""
    from posttrain.generate.sampler import SamplingParams, sample

    cfg = get_preset("tiny-dense")
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.ones((2, 8), jnp.int32)
    logits_hlo = jax.jit(lambda st: nnx.merge(graphdef, st)(tokens)[0]).lower(state).as_text()
    prompts, lengths = jnp.ones((2, 8), jnp.int32), jnp.array([8, 5], jnp.int32)
    sample_hlo = jax.jit(lambda st: sample(graphdef, st, prompts, lengths, jax.random.key(0), group_size=2,
                                           params=SamplingParams(max_new_tokens=3), stop_ids=(0,), pad_id=0
                                           ).tokens_NxLg).lower(state).as_text()
    for name, hlo in (("logits", logits_hlo), ("sampler", sample_hlo)):
        got = dot_precisions(hlo)
        assert got and set(got) == {"HIGHEST"}, (name, sorted(set(got)))


def test_highest_and_default_agree_on_cpu():
    """On this CPU float32 dots are exact either way; the policy changes the HLO, not CPU results."""
    cfg = get_preset("tiny-dense")
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % cfg.vocab_size
    outs = []
    for prec in ("default", "highest"):
        model = nnx.merge(graphdef, state)
        model.matmul_precision = prec
        outs.append(np.asarray(model(tokens)[0]))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,param_dtype,want", [  # (compute, master) the run gets from a bfloat16 checkpoint
    ("auto", "auto", ("float32", "float32")),  # CPU auto: float32 master weights, not the file's bfloat16
    ("auto", "bfloat16", ("float32", "bfloat16")),  # the documented memory choice
    ("bfloat16", "float32", ("bfloat16", "float32")),
])
def test_training_takes_its_dtypes_from_the_policy_not_the_checkpoint(tmp_path, dtype, param_dtype, want):
    """Loaders default to the file's dtype (tests/posttrain/checkpoints), a training run to its
    precision policy, whatever the checkpoint was saved in."""
    from posttrain.checkpoints import policy
    from posttrain.infra import mesh as mesh_lib
    from posttrain.checkpoints.export import export_hf
    from posttrain.config.plan import make_run_plan
    from posttrain.model.tokenizer import Tokenizer

    from helpers import random_model, tiny_config

    cfg, _, state = random_model("tiny-dense", vocab_size=320)
    export_hf(cfg, state, tmp_path / "ckpt", tokenizer=Tokenizer.byte_level(), dtype="bfloat16")
    run = tiny_config(tmp_path / "run", **{"model.preset": "", "model.overrides": {}, "model.path": str(tmp_path / "ckpt"),
                                           "model.dtype": dtype, "model.param_dtype": param_dtype})
    plan = make_run_plan(run, backend="cpu")
    mcfg, _, weights, _ = policy.load_policy(plan.policy, mesh_lib.make_mesh(plan.mesh_shape), plan.rules)
    assert (mcfg.dtype, mcfg.param_dtype) == want
    assert {np.asarray(v.get_value()).dtype.name for _, v in nnx.to_flat_state(weights)} == {want[1]}
