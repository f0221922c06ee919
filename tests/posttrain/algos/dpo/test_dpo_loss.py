"""DPO: each preference loss against its formula in NumPy (float64), the step's loss and metrics against a NumPy
reference built from full-logit forwards of each prompt + reply alone (the packed two-branch layout scores the
same tokens), microbatches (1 vs 2: the same loss and gradients), the reference at the initial policy (loss log 2,
margins 0), and a loss that goes down on a fixed batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_model

from posttrain.algos.dpo import data, losses
from posttrain.algos.dpo import step as dpo_step
from posttrain.config.dpo import LOSS_NAMES
from posttrain.learn import optim
from posttrain.learn.state import create_train_state, merge_model
from posttrain.model.tokenizer import Tokenizer


def np_sigmoid_loss(h, beta, eps):
    log_sig = lambda x: -np.logaddexp(0.0, -x)
    return -(1 - eps) * log_sig(beta * h) - eps * log_sig(-beta * h)


NP_LOSSES = {"sigmoid": np_sigmoid_loss, "ipo": lambda h, beta, eps: (h - 1 / (2 * beta)) ** 2,
             "hinge": lambda h, beta, eps: np.maximum(0.0, 1 - beta * h)}
H = np.asarray([-40.0, -3.0, -0.5, 0.0, 1e-3, 0.7, 2.5, 60.0])


@pytest.mark.parametrize("name,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 2.0, 0.0), ("sigmoid", 0.5, 0.2),
                                           ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0), ("hinge", 0.1, 0.0),
                                           ("hinge", 3.0, 0.0)])
def test_losses_match_their_formulas(name, beta, eps):
    got = np.asarray(losses.loss_fn(name)(jnp.asarray(H, jnp.float32), beta, eps), np.float64)
    np.testing.assert_allclose(got, NP_LOSSES[name](H, beta, eps), rtol=2e-6, atol=1e-6)
    assert np.isfinite(got).all()


def test_registry_and_settings_errors():
    assert sorted(losses.LOSSES) == sorted(LOSS_NAMES)
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'.*registered"):
        losses.loss_fn("kto")
    for args, msg in ((("sigmoid", 0.0, 0.0), "beta must be > 0"), (("sigmoid", 0.1, 0.5), r"\[0, 0.5\)"),
                      (("ipo", 0.1, 0.1), "sigmoid' loss only")):
        with pytest.raises(ValueError, match=msg):
            losses.check_settings(*args)


RECORDS = [{"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
           {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            "chosen": [{"role": "assistant", "content": "4"}], "rejected": "It is five, I think."},
           {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven"},
           {"prompt": "Count to three.", "chosen": "1 2 3", "rejected": "3 2 1 0"}]


@pytest.fixture(scope="module")
def setup():
    tok = Tokenizer.byte_level()
    pairs = data.encode_pairs(tok, [(f"r[{i}]", r) for i, r in enumerate(RECORDS)], data.PairSettings())
    _, graphdef, weights = random_model("tiny-dense", vocab_size=320, std=0.05)
    opt = optim.make_optimizer("adamw", lr=3e-3, schedule="constant")
    graphdef, state = create_train_state(graphdef, weights, opt.tx, jax.random.key(0))
    return tok, pairs, graphdef, state, opt


def np_sequence_logps(model, pairs):
    """float64 [2P]: each reply's summed log-softmax logprob, prompt + reply alone in a row of full logits (one
    row per reply, padded at the end: causal attention makes the padding irrelevant to the tokens before it)."""
    seqs = [np.concatenate([p.prompt, reply]) for p in pairs for reply in (p.chosen, p.rejected)]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = q
    z = np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(tokens)), np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    out = []
    for i, q in enumerate(seqs):
        k = len(pairs[i // 2].prompt)
        out.append(sum(logp[i, t - 1, q[t]] for t in range(k, len(q))))
    return np.asarray(out)


def batch_of(tok, pairs, ref_N, num_pairs=4):
    return jax.tree.map(jnp.asarray, data.make_batch(pairs, *data.regions(pairs), tok.pad_id, num_pairs, ref_N))


def test_layout_step_loss_and_metrics_match_numpy(setup):
    tok, pairs, graphdef, state, _ = setup
    b = data.make_batch(pairs, *data.regions(pairs), tok.pad_id, 4)
    for n, p in enumerate(pairs):  # sample 2p is the chosen reply, 2p + 1 the rejected one
        for j, reply in enumerate((p.chosen, p.rejected)):
            np.testing.assert_array_equal(b.targets_NxC[2 * n + j][b.loss_mask_NxC[2 * n + j]], reply)
    model = merge_model(graphdef, state.params, state.frozen)
    s = np_sequence_logps(model, pairs)
    rng = np.random.default_rng(0)
    ref = s + rng.normal(0, 0.5, s.shape)  # a reference that differs from the policy
    opts = dpo_step.StepOptions(loss="sigmoid", beta=0.3, logprob_chunk=32)
    loss, _, m = jax.jit(lambda st, bb: dpo_step.step_lib.accumulate_gradients(
        dpo_step.make_loss_fn(graphdef, opts), st.params, st.frozen, bb, dpo_step.context(st, bb), 1))(
        state, batch_of(tok, pairs, ref))
    h = (s[0::2] - s[1::2]) - (ref[0::2] - ref[1::2])
    np.testing.assert_allclose(float(loss), np_sigmoid_loss(h, 0.3, 0.0).mean(), rtol=1e-5)
    rc, rr = 0.3 * (s[0::2] - ref[0::2]), 0.3 * (s[1::2] - ref[1::2])
    for key, want in (("rewards/chosen", rc.mean()), ("rewards/rejected", rr.mean()),
                      ("rewards/margins", (rc - rr).mean()), ("rewards/accuracies", (rc > rr).mean()),
                      ("logps/chosen", s[0::2].mean()), ("dpo/pairs", 4.0)):
        np.testing.assert_allclose(float(m[key]), want, rtol=1e-5, atol=1e-5, err_msg=key)


def test_two_microbatches_equal_one_and_the_reference_policy_gives_log2(setup):
    tok, pairs, graphdef, state, _ = setup
    ref_fn = dpo_step.make_reference_fn(graphdef, dpo_step.StepOptions(logprob_chunk=32))
    ref = np.asarray(ref_fn(state.params, state.frozen, batch_of(tok, pairs, None)))
    batch = batch_of(tok, pairs[:3], ref[:6])  # 3 pairs + 1 padding row: the padding pair counts nowhere
    out = {}
    for M in (1, 2):
        opts = dpo_step.StepOptions(loss="ipo", beta=0.5, num_microbatches=M, logprob_chunk=32)
        out[M] = jax.jit(lambda st, bb: dpo_step.step_lib.accumulate_gradients(
            dpo_step.make_loss_fn(graphdef, opts), st.params, st.frozen, bb, dpo_step.context(st, bb), M))(
            state, batch)
    np.testing.assert_allclose(float(out[1][0]), float(out[2][0]), rtol=1e-5)
    np.testing.assert_allclose(float(out[1][0]), (0 - 1 / (2 * 0.5)) ** 2, rtol=1e-5)  # h = 0 at the reference
    assert float(out[1][2]["dpo/pairs"]) == 3.0 and abs(float(out[1][2]["rewards/margins"])) < 1e-6
    for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[2][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_updates_on_a_fixed_batch_lower_the_loss(setup):
    tok, pairs, graphdef, state, opt = setup
    opts = dpo_step.StepOptions(loss="sigmoid", beta=0.5, logprob_chunk=32)
    ref = np.asarray(dpo_step.make_reference_fn(graphdef, opts)(state.params, state.frozen,
                                                                 batch_of(tok, pairs, None)))
    step = jax.jit(dpo_step.make_train_step(graphdef, opt.tx, opt.lr_schedule, opts))
    batch, st, seen = batch_of(tok, pairs, ref), jax.tree.map(jnp.copy, state), []
    for _ in range(6):
        st, m = step(st, batch)
        seen.append((float(m["dpo/loss"]), float(m["rewards/accuracies"])))
    assert seen[0][0] == pytest.approx(np.log(2), rel=1e-5)
    assert seen[-1][0] < 0.6 < seen[0][0] and seen[-1][1] == 1.0, seen
