"""Packed shared-prefix rows: a prompt followed by its G completions in one row (branch ids 1..G, positions
restarting after the prompt), possibly several such groups per row (segment ids), give the same logits as each
prompt + completion run on its own; the sampler's lengths follow positions (pad == EOS).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.model.blockwise_attention import self_mask
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample
from helpers import completion_lengths, random_model

EOS = PAD = 2




def pack(groups, width):
    """groups: [(prompt, [completion, ...]), ...] -> tokens, positions, segment_ids, branch_ids [1, width] and,
    per (group, completion), the packed column of each completion token and of the prompt tokens."""
    tok, pos, seg, br = (np.zeros(width, np.int32) for _ in range(4))
    cols, i = [], 0
    for s, (prompt, completions) in enumerate(groups, start=1):
        lp = len(prompt)
        tok[i:i + lp], pos[i:i + lp], seg[i:i + lp] = prompt, np.arange(lp), s
        prompt_cols = np.arange(i, i + lp)
        i += lp
        for b, c in enumerate(completions, start=1):
            tok[i:i + len(c)], pos[i:i + len(c)], seg[i:i + len(c)], br[i:i + len(c)] = c, lp + np.arange(len(c)), s, b
            cols.append((prompt_cols, np.arange(i, i + len(c))))
            i += len(c)
    assert i <= width
    return [a[None] for a in (tok, pos, seg, br)], cols


def _forward(graphdef, state):
    return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a)[0])


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-deepseek"])
def test_packed_shared_prefix_rows_match_unpacked(preset):
    cfg, graphdef, state = random_model(preset)
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(3, cfg.vocab_size, n).tolist()
    groups = [(draw(7), [draw(5), draw(3), draw(6)]), (draw(4), [draw(8), draw(2)])]
    arrays, cols = pack(groups, 64)  # trailing columns are padding (segment 0)
    fwd = _forward(graphdef, state)
    packed = np.asarray(fwd(state, *map(jnp.asarray, arrays)))[0]
    assert np.isfinite(packed).all() and packed.std() > 0.5
    pairs = [(p, c) for p, cs in groups for c in cs]
    # The two runs sum the same float32 terms in a different order (the packed row interleaves other groups'
    # masked keys; a narrower row changes XLA's reduction blocks too). Over 12 seeds x 3 presets on the CPU:
    # at the packed width <= 5.9e-6 (<= 1e-6 x max|logit|); at width 32 up to 1.5e-5. So compare at the packed
    # width, with a tolerance of 3e-6 x the logit scale (~3x the worst seen). A
    # masking, position or branch bug moves logits by O(1), five orders above it.
    for (prompt, completion), (pcols, ccols) in zip(pairs, cols):
        seq = prompt + completion  # right-padded to the packed width (one compile), padding in segment 0
        tok, seg = np.zeros((1, 64), np.int32), np.zeros((1, 64), np.int32)
        tok[0, :len(seq)], seg[0, :len(seq)] = seq, 1
        pos = np.arange(64, dtype=np.int32)[None]
        alone = np.asarray(fwd(state, tok, pos, seg, np.zeros_like(seg)))[0]
        atol = 3e-6 * np.abs(alone[:len(seq)]).max()
        np.testing.assert_allclose(packed[pcols], alone[:len(prompt)], rtol=0, atol=atol)
        np.testing.assert_allclose(packed[ccols], alone[len(prompt):len(seq)], rtol=0, atol=atol)


def test_attention_mask_rules():
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 0]])
    br = jnp.asarray([[0, 1, 2, 2, 0, 1, 0]])
    m = np.asarray(self_mask(seg, br, blockwise=False))[0].astype(int)
    expected = np.array([[1, 0, 0, 0, 0, 0, 0],   # prompt token: itself
                         [1, 1, 0, 0, 0, 0, 0],   # branch 1: prompt + itself
                         [1, 0, 1, 0, 0, 0, 0],   # branch 2 does not see branch 1
                         [1, 0, 1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 1, 0, 0],   # new segment: nothing of segment 1
                         [0, 0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 0, 0, 0]])  # padding attends to nothing
    np.testing.assert_array_equal(m, expected)


def test_sampled_group_packed_in_one_row_reproduces_sampler_logprobs():
    """Sampler -> lengths -> one packed row per prompt -> teacher-forced logprobs == sampler logprobs."""
    cfg, graphdef, state = random_model("tiny-moe", seed=2)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 9)]
    G, T = 3, 0.8
    tokens, lens = pad_prompts(prompts, PAD, bucket=8)
    stops = tuple(range(1, 40))  # a quarter of the vocabulary: samples stop early; PAD == EOS == 2 is one of them
    for key in range(8):  # first key whose draws hold both short and long samples
        out = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lens), jax.random.key(key), group_size=G,
                     params=SamplingParams(max_new_tokens=12, temperature=T), stop_ids=stops, pad_id=PAD)
        toks, lengths, logp = map(np.asarray, (out.tokens_NxLg, out.lengths_N, out.logp_NxLg))
        if lengths.min() < 12 and lengths.max() > 4:
            break
    assert lengths.min() < 12 and lengths.max() > 4, lengths
    np.testing.assert_array_equal(np.asarray(completion_lengths(toks, stops)), lengths)
    fwd = _forward(graphdef, state)
    worst = 0.0
    for p, prompt in enumerate(prompts):
        rows = range(p * G, (p + 1) * G)
        (arrays, cols) = pack([(prompt, [toks[n, :lengths[n]].tolist() for n in rows])], 64)
        logits = np.asarray(fwd(state, *map(jnp.asarray, arrays)))[0] / T
        logp_all = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
        for n, (pcols, ccols) in zip(rows, cols):
            # token j of a completion is predicted at the column before it (the prompt's last token for j = 0)
            pred = np.concatenate([pcols[-1:], ccols[:-1]])
            tf = logp_all[pred, toks[n, :lengths[n]]]
            worst = max(worst, float(np.abs(tf - logp[n, :lengths[n]]).max()))
            assert (logp[n, lengths[n]:] == 0).all()
    assert worst <= 1e-4, worst
