"""Tokenizer parity with transformers (GGUF and HF-directory paths), chat templates, and masks by position when
pad == EOS through the rollout pipeline (the tokenizer's pad and stop ids -> episodes -> batching)."""

import json

import jax
import jinja2
import numpy as np
import pytest
from helpers import pad_is_eos_tokenizer, smollm2_path

from posttrain.checkpoints.gguf import read_gguf_metadata
from posttrain.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")  # a transformers dependency; used for the llama.cpp reference split

TEXTS = [
    "Hello world", "What is 23 + 58? Answer with just the number.", "3.14159 x 1e-9 = 0.000000003",
    "déjà vu — naïve café, Ünïcödé ß ſ", "日本語のテキスト、中文句子。한국어", "emoji 🤖🚀 and ZWJ 👩‍💻",
    "def f(x):\n    return x ** 2  # square\n", "\tTabs\tand\r\nCRLF\n\n\nnewlines", "trailing spaces   ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|im_end|>text", "",
    "It's we'll they've I'd", "x = [1, 2, 3]; y = {'a': 10}", "   leading", "a\u00a0b\u2009c", "1234567890",
]
# A whitespace run before a digit: llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) isolates
# digits before the GPT-2 split, so "x\n 1" is [x, "\n ", 1]; transformers' GGUF converter has no "smollm" case
# and falls back to plain GPT-2 splitting, [x, "\n", " ", 1]. We follow llama.cpp here (see test below).
DIGIT_AFTER_WHITESPACE = ["a  1", "x\n 1", "  3.14", "x  \n  42", "1.\n  2.\n    3", "sup ²³ ½"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 7 ducks."}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm2_path()))


@pytest.fixture(scope="module")
def theirs():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _llama_cpp_smollm_reference(text, theirs):
    """llama.cpp "smollm": split by \\p{N}, then the GPT-2 regex; BPE each piece (transformers' BPE is the same)."""
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    pieces = [p for chunk in regex.split(r"(\p{N})", text) for p in regex.findall(gpt2, chunk)]
    return [i for p in pieces for i in theirs.encode(p, add_special_tokens=False)]


def test_encode_decode_match_transformers(ours, theirs):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.encode_batch(TEXTS) == [theirs.encode(t, add_special_tokens=False) for t in TEXTS]
    batch = [ours.encode(t) for t in TEXTS]
    assert ours.batch_decode(batch) == theirs.batch_decode(batch, skip_special_tokens=True)
    assert ours.decode(np.array([*ours.encode("Hello world"), 2])) == "Hello world"  # numpy ids, EOS skipped


def test_digits_are_isolated_like_llama_cpp(ours, theirs):
    for text in TEXTS + DIGIT_AFTER_WHITESPACE:
        if "<|" not in text:
            assert ours.encode(text) == _llama_cpp_smollm_reference(text, theirs), text
    assert [ours.backend.id_to_token(i) for i in ours.encode("x\n 1")] == ["x", "ĊĠ", "1"]
    for text in DIGIT_AFTER_WHITESPACE:
        assert ours.decode(ours.encode(text)) == text


def test_special_ids_match_transformers(ours, theirs):
    assert (ours.vocab_size, ours.eos_id, ours.pad_id, ours.bos_id) == (len(theirs), theirs.eos_token_id,
                                                                       theirs.pad_token_id, theirs.bos_token_id)
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (2, 2, 1)
    assert ours.stop_ids == (theirs.convert_tokens_to_ids("<|im_end|>"),) == (2,)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, add_generation_prompt):
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        assert ids == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_environment_matches_transformers(ours, theirs, tmp_path):
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
                "{{ bos_token }}|{{ eos_token }}|{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ extra }}\n"
                "  {% if messages | length > 2 %}{{ raise_exception('too long: ' ~ messages | length) }}{% endif %}")
    messages = [{"role": "user", "content": "<b>\"é\"</b>", "name": None}]
    mine = Tokenizer(ours.backend, eos_token="<|im_end|>", bos_token="<|im_start|>", chat_template=template)
    expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False, extra="X")
    assert mine.apply_chat_template(messages, extra="X") == expected
    assert '"<b>\\"é\\"</b>"' in expected  # tojson without HTML escaping or ascii escapes
    with pytest.raises(jinja2.TemplateError, match="too long: 3"):
        mine.apply_chat_template(messages * 3)
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(ours.backend, eos_token="<|im_end|>",
                  chat_template="{% set ns = namespace(_x=1) %}").apply_chat_template(messages)
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(ours.backend, eos_token="<|im_end|>").apply_chat_template(messages)
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])


def test_hf_dir_round_trip(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + DIGIT_AFTER_WHITESPACE:  # tokenizer.json keeps transformers' own pre-tokenizer
        assert loaded.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert (loaded.eos_id, loaded.pad_id, loaded.bos_id, loaded.vocab_size) == (2, 2, 1, 49152)
    assert loaded.stop_ids == ours.stop_ids
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_hf_dir_config_variants(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(chat_template=[{"name": "default", "template": template}, {"name": "tool_use", "template": "x"}],
                  eos_token={"content": "<|endoftext|>", "special": True}, pad_token=None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.chat_template == template
    assert (loaded.eos_id, loaded.pad_id) == (0, 0)  # no pad token: pad falls back to EOS
    assert loaded.stop_ids == (0, 2)  # EOS plus the template's end-of-turn token <|im_end|>
    config.pop("eos_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no eos_token"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def test_gguf_metadata_errors():
    metadata = read_gguf_metadata(smollm2_path())
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.merges'"):
        Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"})
    with_bos = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("Hi", add_special_tokens=True) == [1, *with_bos.encode("Hi")]


# ----- position-based masks (docs/design.md invariant 2) through what the RL pipeline calls ------------------------

def _rollout(tok, turns, packed):
    """`episodes.run_episodes` over one prompt and len(turns[0]) samples, with a stand-in sampler that returns
    `turns[t]` ((tokens, length, truncated) per active row, padded with `tok.pad_id` after the length, as the sampler
    writes them) and an env that ends the episode after len(turns) turns, then `batching.assemble`."""
    from posttrain.algos.grpo.advantages import advantage_fn
    from posttrain.rollout import batching, episodes
    from posttrain.generate.sampler import SampleOutput

    G, width, calls = len(turns[0]), 6, []

    def sample_fn(prompts, lengths, key, group):
        rows = turns[len(calls)]
        calls.append(group)
        tokens = np.full((len(rows), width), tok.pad_id, np.int32)
        for r, (ids, n, _) in enumerate(rows):
            tokens[r, :len(ids)] = ids
        lengths_N = np.asarray([n for _, n, _ in rows], np.int32)
        logp = np.where(np.arange(width) < lengths_N[:, None], -0.5, 0.0).astype(np.float32)
        return SampleOutput(tokens, logp, lengths_N, np.asarray([t for _, _, t in rows]))

    class Envs:
        def reset(self, eps):
            return [("What is 1 + 1?", {})] * len(eps)

        def step(self, actions, indices=None):
            last = len(calls) == len(turns)
            return [("Try again.", float(i % 2), last, False, {"status": "ok" if last else "wrong"})
                    for i, _ in enumerate(actions)]

    samples, _ = episodes.run_episodes(sample_fn, tok, Envs(), [episodes.Episode("stub", {}, {}, 0)],
                                       group_size=G, max_turns=len(turns), key=jax.random.key(0), pad_id=tok.pad_id)
    batch, _ = batching.assemble(samples, advantage_fn("grpo"), group_size=G, pad_id=tok.pad_id, packed=packed)
    return samples, batch


def _expect(batch, n, segments):
    """Row n's targets and loss mask are the concatenated (tokens, is_policy) segments, then padding."""
    want_t = np.concatenate([t for t, _ in segments])
    want_m = np.concatenate([np.full(len(t), pol) for t, pol in segments])
    k, C = len(want_t), batch.loss_mask_NxC.shape[1]
    np.testing.assert_array_equal(batch.targets_NxC[n, :k], want_t)
    np.testing.assert_array_equal(batch.loss_mask_NxC[n], np.concatenate([want_m, np.zeros(C - k, bool)]))


@pytest.mark.parametrize("packed", [True, False])
def test_single_turn_loss_mask_is_the_sampled_positions_when_pad_is_eos(packed):
    """pad == EOS: the sampled stop token is trained, the EOS-valued padding after it is not, a truncated row is
    trained whole; only the sampler's lengths (positions) separate them."""
    tok = pad_is_eos_tokenizer()
    E, x, y = tok.eos_id, *tok.encode("ab")
    assert tok.pad_id == E and E in tok.stop_ids
    samples, batch = _rollout(tok, [[([x, E], 2, False), ([E], 1, False), ([x, y, x, y, x, y], 6, True)]], packed)
    assert [s.segments[0][0].tolist() for s in samples] == [[x, E], [E], [x, y, x, y, x, y]]
    for n, ids in enumerate(([x, E], [E], [x, y, x, y, x, y])):
        _expect(batch, n, [(np.asarray(ids), True)])
    assert batch.loss_mask_NxC.sum() == 9 and (batch.targets_NxC[batch.loss_mask_NxC] == E).sum() == 2


def test_multi_turn_template_tokens_equal_to_eos_are_masked_out():
    """Between turns the chat template writes its end-of-turn token (== EOS == pad) around the env's reply: those
    tokens are in the row but out of the loss; the model's own stop tokens are in it."""
    tok = pad_is_eos_tokenizer()
    E, x = tok.eos_id, tok.encode("a")[0]
    samples, batch = _rollout(tok, [[([x, E], 2, False), ([x, x, x, x, x, x], 6, True)],
                                    [([E], 1, False), ([x, E], 2, False)]], packed=False)
    for n, (first, second) in enumerate((([x, E], [E]), ([x] * 6, [x, E]))):
        bridge = samples[n].segments[1][0]
        assert E in bridge.tolist()  # an EOS-valued token the loss must skip
        _expect(batch, n, [(np.asarray(first), True), (bridge, False), (np.asarray(second), True)])
