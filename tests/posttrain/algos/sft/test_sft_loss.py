"""The SFT loss: a NumPy reference (log-softmax NLL over the assistant tokens of each conversation run alone),
invariant 3 (packed vs unpacked rows, 2 microbatches vs 1 and rows at `packing.batch_shape` vs seq_len give the same
loss and gradients, <= 1e-5 float32),
held-out NLL / perplexity, and a loss that goes down on a memorisable batch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.algos.sft import data, packing
from posttrain.algos.sft import step as sft_step
from posttrain.learn import optim
from posttrain.learn.state import create_train_state, merge_model
from posttrain.model.presets import get_preset
from posttrain.model.tokenizer import Tokenizer
from posttrain.model.transformer import Transformer

WIDTH = 96


def conversations():
    """Six conversations of different lengths: one- and two-turn chats, a system turn, a prompt-completion pair."""
    chats = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
        {"prompt": "Name a colour.", "completion": "Blue."},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d e f"}]},
        {"prompt": "Count to three.", "completion": "1 2 3"},
        {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]},
    ]
    tok = Tokenizer.byte_level()
    examples, _ = data.tokenize(tok, [(f"chat[{i}]", c) for i, c in enumerate(chats)], WIDTH)
    return tok, examples


@pytest.fixture(scope="module")
def setup():
    tok, examples = conversations()
    cfg = get_preset("tiny-dense", vocab_size=320)
    graphdef, weights = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    opt = optim.make_optimizer("adamw", lr=1e-3, schedule="constant")
    graphdef, state = create_train_state(graphdef, weights, opt.tx, jax.random.key(0))
    return tok, examples, graphdef, state


_JITTED = {}


def loss_and_grads(graphdef, state, batch, M=1):
    """(loss, grads, metrics) of `sft_step.accumulate_gradients`, one compilation per M and batch shape."""
    if M not in _JITTED:
        opts = sft_step.StepOptions(num_microbatches=M, logprob_chunk=32)
        _JITTED[M] = jax.jit(lambda s, b: sft_step.accumulate_gradients(graphdef, s, b, opts))
    loss, grads, metrics = _JITTED[M](state, jax.tree.map(jnp.asarray, batch))
    return float(loss), grads, {k: float(v) for k, v in metrics.items()}


def numpy_reference(model, examples):
    """Mean over every assistant token t >= 1 of -log_softmax(logits[t - 1])[token t] (float64), each conversation
    in its own row of full logits (causal: the padding after it changes nothing before it)."""
    tokens = np.zeros((len(examples), WIDTH), np.int32)
    for i, ex in enumerate(examples):
        tokens[i, :len(ex.tokens_n)] = ex.tokens_n
    z = np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(tokens)), np.float64)
    total, count = 0.0, 0
    for i, ex in enumerate(examples):
        logp = z[i] - z[i].max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        t = np.flatnonzero(ex.assistant_n[1:]) + 1
        total += -logp[t - 1, ex.tokens_n[t]].sum()
        count += len(t)
    return total / count, count


def test_loss_matches_numpy_reference(setup):
    tok, examples, graphdef, state = setup
    ref, count = numpy_reference(merge_model(graphdef, state.params, state.frozen), examples)
    batch = packing.make_batch(examples, packing.pack(examples, WIDTH), WIDTH, tok.pad_id, num_rows=len(examples))
    loss, _, m = loss_and_grads(graphdef, state, batch)
    assert m["sft/tokens"] == count > 20
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    np.testing.assert_allclose(m["sft/loss"], ref, rtol=1e-5)
    assert 4.0 < loss < 8.0  # a random init is near ln(320) = 5.77 nats


def test_packed_unpacked_and_microbatches_give_the_same_loss_and_gradients(setup):
    tok, examples, graphdef, state = setup
    rows = packing.pack(examples, WIDTH)
    assert len(rows) < len(examples) and max(len(r) for r in rows) > 1  # really packed
    packed = packing.make_batch(examples, rows, WIDTH, tok.pad_id, num_rows=len(examples))  # the unpacked shape
    unpacked = packing.make_batch(examples, packing.pack(examples, WIDTH, packing=False), WIDTH, tok.pad_id)
    unpacked_rows = packing.pack(examples, WIDTH, packing=False)
    L, C = packing.batch_shape(examples, unpacked_rows, WIDTH)
    assert C < L < WIDTH  # sized by the data (a recipe's batches): narrower rows, fewer scored slots
    narrow = packing.make_batch(examples, unpacked_rows, L, tok.pad_id, slots=C)
    results = {"packed": loss_and_grads(graphdef, state, packed), "unpacked": loss_and_grads(graphdef, state, unpacked),
               "packed M=2": loss_and_grads(graphdef, state, packed, M=2),
               "unpacked M=2": loss_and_grads(graphdef, state, unpacked, M=2),
               "unpacked at batch_shape": loss_and_grads(graphdef, state, narrow)}
    loss0, grads0, m0 = results["packed"]
    assert float(jnp.abs(jax.tree.leaves(grads0)[0]).max()) > 0
    for name, (loss, grads, m) in results.items():
        np.testing.assert_allclose(loss, loss0, atol=1e-5, rtol=1e-5, err_msg=name)
        assert m["sft/tokens"] == m0["sft/tokens"], name
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=name)


def test_eval_fn_gives_nll_sum_and_perplexity(setup):
    tok, examples, graphdef, state = setup
    ref, count = numpy_reference(merge_model(graphdef, state.params, state.frozen), examples)
    eval_fn = sft_step.make_eval_fn(graphdef, sft_step.StepOptions(logprob_chunk=32))
    nll, tokens = 0.0, 0.0
    batches = packing.eval_batches(examples, WIDTH, 2, tok.pad_id)
    assert len(batches) >= 2 and {b.tokens_RxL.shape for b in batches} == {(2, WIDTH)}
    assert not batches[-1].valid_N[-1] or len(packing.pack(examples, WIDTH)) % 2 == 0
    for b in batches:
        s, n = eval_fn(state.params, state.frozen, jax.tree.map(jnp.asarray, b))
        nll, tokens = nll + float(s), tokens + float(n)
    m = sft_step.perplexity(nll, tokens)
    assert m["sft/eval_tokens"] == count
    np.testing.assert_allclose(m["sft/eval_loss"], ref, rtol=1e-5)
    np.testing.assert_allclose(m["sft/ppl"], np.exp(ref), rtol=1e-4)
    assert np.isnan(sft_step.perplexity(0.0, 0.0)["sft/ppl"])


def test_loss_goes_down_over_a_few_steps_on_a_memorisable_batch(setup):
    tok, examples, graphdef, state = setup
    batch = packing.make_batch(examples, packing.pack(examples, WIDTH), WIDTH, tok.pad_id, num_rows=len(examples))
    tx = optim.make_optimizer("adamw", lr=1e-2, schedule="constant").tx
    @jax.jit
    def apply(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state, seen = state.params, tx.init(state.params), []
    for _ in range(5):  # the compiled loss-and-gradient function of the tests above, updates applied here
        loss, grads, _ = loss_and_grads(graphdef, state.replace(params=params), batch)
        params, opt_state = apply(grads, opt_state, params)
        seen.append(loss)
    assert all(b < a for a, b in zip(seen, seen[1:])) and seen[-1] < 0.8 * seen[0], seen
