"""Rollout batch assembly: packed == unpacked for the loss, position-based masks, infra errors excluded,
advantages exactly zero for equal-reward groups (invariants 2, 4, 5, 6)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.rollout import batching

from posttrain.algos.grpo import losses
from posttrain.algos.grpo import step
from posttrain.model.presets import get_preset
from posttrain.model.transformer import Transformer
from posttrain.rollout.episodes import Sample
from posttrain.types import TrainState

EOS = PAD = 2  # pad id equals EOS, as in SmolLM2


def make_samples(G=3, P=2, seed=0, statuses=None):
    rng = np.random.RandomState(seed)
    out = []
    for p in range(P):
        prompt = list(rng.randint(3, 100, size=5 + p))
        for g in range(G):
            n = int(rng.randint(1, 7))
            toks = np.asarray(list(rng.randint(3, 100, size=n - 1)) + [EOS], np.int32)
            s = Sample(domain="d", group=p, prompt_ids=prompt, segments=[(toks, -rng.rand(n).astype(np.float32), True)],
                       reward=float(rng.rand() > 0.5), status="ok", done=True)
            out.append(s)
    for i, st in (statuses or {}).items():
        out[i].status = st
    return out


def test_packed_and_unpacked_give_the_same_loss_and_gradient():
    samples = make_samples()
    packed, _ = batching.assemble(samples, advantage_fn("grpo"), group_size=3, pad_id=PAD, packed=True)
    unpacked, _ = batching.assemble(samples, advantage_fn("grpo"), group_size=3, pad_id=PAD, packed=False)
    assert packed.tokens_RxL.shape[0] == 2 and unpacked.tokens_RxL.shape[0] == 6
    np.testing.assert_array_equal(packed.loss_mask_NxC, unpacked.loss_mask_NxC)
    graphdef, params, other = nnx.split(Transformer(get_preset("tiny-dense"), rngs=nnx.Rngs(0)), nnx.Param, ...)
    st = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None,
                    frozen={"base": None, "other": other}, ref_params=None, rng=jax.random.key(0))
    opts = step.StepOptions(loss=losses.LossConfig(), temperature=1.0)
    run = jax.jit(lambda b: step.accumulate_gradients(graphdef, st, jax.tree.map(jnp.asarray, b), opts))
    (g1, m1), (g2, m2) = run(packed), run(unpacked)
    np.testing.assert_allclose(m1["policy/loss"], m2["policy/loss"], atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_masks_come_from_positions_when_pad_equals_eos():
    s = make_samples(G=1, P=1)
    s[0].segments = [(np.asarray([5, 9, EOS], np.int32), np.zeros(3, np.float32), True)]
    s[0].reward = 1.0
    batch, _ = batching.assemble(s, advantage_fn("grpo"), group_size=1, pad_id=PAD, completion_bucket=5)
    np.testing.assert_array_equal(batch.targets_NxC[0], [5, 9, EOS, PAD, PAD])
    np.testing.assert_array_equal(batch.loss_mask_NxC[0], [1, 1, 1, 0, 0])


def test_infra_errors_are_excluded_not_scored_wrong():
    samples = make_samples(statuses={0: "infra_error"})
    samples[0].reward = 0.0
    batch, m = batching.assemble(samples, advantage_fn("grpo"), group_size=3, pad_id=PAD)
    assert not batch.valid_N[0] and batch.advantages_N[0] == 0.0
    assert not batch.loss_mask_NxC[0].any()
    assert m["env/infra_error_rate"] == pytest.approx(1 / 6)


def test_equal_reward_group_has_exactly_zero_advantage():
    samples = make_samples()
    for s in samples[:3]:
        s.reward = 0.35
    batch, m = batching.assemble(samples, advantage_fn("grpo"), group_size=3, pad_id=PAD)
    assert np.all(batch.advantages_N[:3] == 0.0)
    assert m["frac_zero_std_groups"] >= 0.5


def test_rows_padded_to_the_microbatch_multiple_are_inert():
    batch, _ = batching.assemble(make_samples(P=2), advantage_fn("grpo"), group_size=3, pad_id=PAD, row_multiple=4)
    assert batch.tokens_RxL.shape[0] == 4 and batch.targets_NxC.shape[0] == 12
    assert not batch.loss_mask_NxC[6:].any() and not batch.valid_N[6:].any()
    assert not batch.segment_ids_RxL[2:].any()


def test_multi_turn_env_tokens_are_masked_out():
    s = make_samples(G=1, P=1)
    s[0].segments = [(np.asarray([7, 8, EOS], np.int32), np.full(3, -0.5, np.float32), True),
                     (np.asarray([40, 41], np.int32), np.zeros(2, np.float32), False),
                     (np.asarray([9, EOS], np.int32), np.full(2, -0.25, np.float32), True)]
    batch, m = batching.assemble(s, advantage_fn("grpo"), group_size=1, pad_id=PAD, packed=True)  # multi-turn falls back to unpacked
    np.testing.assert_array_equal(batch.loss_mask_NxC[0, :7], [1, 1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(batch.targets_NxC[0, :7], [7, 8, EOS, 40, 41, 9, EOS])
    assert m["response_length/mean"] == 5


def test_incomplete_groups_raise():
    with pytest.raises(ValueError, match="complete contiguous groups"):
        batching.assemble(make_samples()[:4], advantage_fn("grpo"), group_size=3, pad_id=PAD)
