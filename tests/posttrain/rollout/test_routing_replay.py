"""MoE routing replay (`rl.routing_replay`): the sampler records every token's experts per MoE layer, the batch
carries them in the packed row layout, and the train step selects them while gate values come from the current
weights. Perturbing only the selection bias (`score_bias`: changes which experts are chosen, not their gate
values) between sampling and training leaves the sampler/trainer ratio at 1 with replay, and not without."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import random_model
from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn.state import create_train_state
from posttrain.learn.logprobs import score_logprobs
from posttrain.rollout import batching
from posttrain.algos.grpo import losses
from posttrain.learn import optim
from posttrain.algos.grpo import step as step_lib
from posttrain.rollout.episodes import Sample
from posttrain.generate.sampler import SamplingParams, sample

P, G, LG = 2, 3, 6
PROMPTS = np.array([[5, 6, 7, 8, 9, 10, 0, 0], [5, 6, 7, 11, 12, 0, 0, 0]], np.int32)
LENGTHS = np.array([6, 5], np.int32)


@pytest.fixture(scope="module")
def sampled():
    cfg, graphdef, state = random_model("tiny-deepseek")
    out = sample(graphdef, state, PROMPTS, LENGTHS, jax.random.key(1), group_size=G,
                 params=SamplingParams(max_new_tokens=LG, temperature=1.0), stop_ids=(1,), pad_id=0,
                 record_routing=True, shared_prefix_len=3)
    return cfg, graphdef, state, jax.tree.map(np.asarray, out)


def _samples(out, with_routing=True):
    samples = []
    for n in range(P * G):
        p, k = n // G, int(out.lengths_N[n])
        prompt = PROMPTS[p, :LENGTHS[p]].tolist()
        routing = np.concatenate([out.prompt_experts_PxLpxLxk[p, :LENGTHS[p]], out.experts_NxLgxLxk[n, :k]])
        samples.append(Sample(domain="t", group=p, prompt_ids=prompt, status="ok", done=True, reward=float(n % 2),
                              segments=[(out.tokens_NxLg[n, :k], out.logp_NxLg[n, :k], True)],
                              routing=routing if with_routing else None))
    return samples


def test_recorded_routing_is_the_teacher_forced_selection(sampled):
    cfg, graphdef, state, out = sampled
    L, k = cfg.num_moe_layers, cfg.moe.num_experts_per_tok
    assert out.prompt_experts_PxLpxLxk.shape == (P, PROMPTS.shape[1], L, k)
    assert out.experts_NxLgxLxk.shape == (P * G, LG, L, k)
    seqs = [np.concatenate([PROMPTS[n // G, :LENGTHS[n // G]], out.tokens_NxLg[n, :out.lengths_N[n]]])
            for n in range(P * G)]
    tokens = np.zeros((P * G, max(map(len, seqs))), np.int32)
    segments = np.zeros_like(tokens)
    for n, seq in enumerate(seqs):
        tokens[n, :len(seq)], segments[n, :len(seq)] = seq, 1
    routed = jax.jit(lambda st, t, s: nnx.merge(graphdef, st).hidden_states(t, segment_ids_BxT=s)[1]["routed_experts"])
    forced = np.sort(np.asarray(routed(state, tokens, segments)), -1).transpose(1, 2, 0, 3)  # [N, T, L, k]
    for n in range(P * G):
        p, n_gen = n // G, int(out.lengths_N[n])
        recorded = np.concatenate([out.prompt_experts_PxLpxLxk[p, :LENGTHS[p]], out.experts_NxLgxLxk[n, :n_gen - 1]])
        np.testing.assert_array_equal(np.sort(recorded, -1), forced[n, :len(seqs[n]) - 1])
        assert (out.experts_NxLgxLxk[n, n_gen - 1:] == -1).all()  # the last token is never fed back


def test_packed_batch_places_routing_with_its_tokens(sampled):
    _, _, _, out = sampled
    samples = _samples(out)
    batch, _ = batching.assemble(samples, advantage_fn("grpo"), group_size=G, row_multiple=4)
    r = batch.routed_experts_RxLxLmxk
    assert r.shape[:2] == batch.tokens_RxL.shape and r.dtype == np.int32
    assert (r[P:] == -1).all() and (r[batch.segment_ids_RxL == 0] == -1).all()  # padding rows and slots
    for n, s in enumerate(samples):
        p = n // G
        np.testing.assert_array_equal(r[p, :LENGTHS[p]], s.routing[:LENGTHS[p]])
        # each completion token sits where the batch scores the next one from: score_pos[c + 1] = its position
        k = s.completion_len
        pos = batch.score_pos_NxC[n, 1:k]
        np.testing.assert_array_equal(r[p, pos], s.routing[LENGTHS[p]:LENGTHS[p] + k - 1])
    assert batching.assemble(_samples(out, False), advantage_fn("grpo"), group_size=G)[0].routed_experts_RxLxLmxk is None


def _perturbed_bias(state, seed=7):
    """The model state with every MoE layer's selection bias replaced by large random values."""
    rng = np.random.default_rng(seed)

    def one(path, v):
        if "score_bias" not in jax.tree_util.keystr(path):
            return v
        return v.replace(jnp.asarray(3.0 * rng.standard_normal(v.shape), v.dtype))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_replay_keeps_the_step0_ratio_at_one_when_the_selection_bias_moves(sampled):
    _, graphdef, state, out = sampled
    batch, _ = batching.assemble(_samples(out), advantage_fn("grpo"), group_size=G)
    replay = jax.tree.map(jnp.asarray, batch)
    off = replay.replace(routed_experts_RxLxLmxk=jnp.full_like(replay.routed_experts_RxLxLmxk, -1))  # route anew
    state = _perturbed_bias(state)
    mask = np.asarray(batch.loss_mask_NxC)
    score = jax.jit(lambda st, b: score_logprobs(nnx.merge(graphdef, st), b, 1.0, chunk=16)[0].logp_BxT)
    # one GRPO step: its truncated-importance weight exp(logp_old - logp_sample) is the sampler/trainer ratio
    opts = step_lib.StepOptions(loss=losses.LossConfig(tis_cap=1e6), temperature=1.0)
    opt = optim.make_optimizer("adamw", lr=1e-3, schedule="constant")
    gd, train_state = create_train_state(graphdef, state, opt.tx, jax.random.key(0), lora_rank=opts.lora_rank)
    step = jax.jit(step_lib.make_train_step(gd, opt.tx, opt.lr_schedule, opts))
    for b, is_replay in ((replay, True), (off, False)):
        # the trainer's logprobs against the sampler's on every policy token
        log_ratio = np.abs(np.asarray(score(state, b)) - batch.logp_sample_NxC)[mask]
        tis = float(step(train_state, b)[1]["policy/tis_weight"])
        if is_replay:
            assert log_ratio.max() < 1e-4 and abs(tis - 1) < 1e-5, (log_ratio.max(), tis)
        else:
            assert log_ratio.max() > 1e-2 and abs(tis - 1) > 1e-3, (log_ratio.max(), tis)


def test_replay_on_a_dense_model_is_one_clear_error(tmp_path):
    """rl.routing_replay='replay' on a model without MoE layers would replay nothing: the run stops at load, before
    any step or checkpoint, with one ConfigError."""
    from helpers import tiny_config
    from posttrain.config import ConfigError
    from posttrain.recipes import grpo

    with pytest.raises(ConfigError, match=r"^rl.routing_replay='replay' replays .* has no MoE layers"):
        grpo.train(tiny_config(tmp_path, **{"rl.routing_replay": "replay"}), progress=False)
    assert not list(tmp_path.glob("checkpoints/*")) and not (tmp_path / "metrics.jsonl").exists()
