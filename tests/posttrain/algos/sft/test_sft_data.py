"""SFT data: TRL record formats, the assistant mask by position (pad id == EOS id), one clear error per bad record,
best-fit-decreasing packing and the batch layout."""
import itertools
import json

import numpy as np
import pytest

from helpers import pad_is_eos_tokenizer

from posttrain.algos.sft import data, packing
from posttrain.config import DataError
from posttrain.model.tokenizer import Tokenizer


def test_assistant_mask_is_by_position_when_pad_is_eos():
    tok = pad_is_eos_tokenizer()
    # the user says exactly what the assistant says: a mask by token value could not tell the two apart
    record = {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"},
                           {"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]}
    ex = data.encode(tok, *data.to_messages(record, "r"), "r")
    assert tok.decode(ex.tokens_n[ex.assistant_n], skip_special_tokens=False) == "ok<|im_end|>ok<|im_end|>"
    o = tok.encode("o")[0]
    assert (ex.tokens_n == o).sum() == 4 and (ex.tokens_n[ex.assistant_n] == o).sum() == 2  # the users' are not
    first = np.flatnonzero(ex.assistant_n)[0]
    assert tok.decode(ex.tokens_n[:first], skip_special_tokens=False).endswith("user\nok<|im_end|>\n"
                                                                             "<|im_start|>assistant\n")
    # packed with a short one and padded with EOS-valued pad tokens: only the two turns' end tokens are targets
    short = data.encode(tok, *data.to_messages({"prompt": "x", "completion": "y"}, "s"), "s")
    batch = packing.make_batch([ex, short], [[0, 1]], 96, tok.pad_id, num_rows=2)
    n = len(ex.tokens_n) + len(short.tokens_n)
    assert (batch.tokens_RxL[0, n:] == tok.eos_id).all() and n < 96  # padding really is EOS-valued
    mask = batch.loss_mask_NxC[0]
    assert mask.sum() == ex.assistant_n[1:].sum() + short.assistant_n[1:].sum() == 3 * 2 + 2
    assert (batch.targets_NxC[0][mask] == tok.eos_id).sum() == 3  # three assistant turns end, padding never
    assert (batch.score_pos_NxC[0][mask] < n - 1).all()
    assert batch.segment_ids_RxL[0, n - 1] == 2 and batch.segment_ids_RxL[0, n] == 0
    assert not batch.loss_mask_NxC[1].any() and not batch.valid_N[1]


def test_prompt_completion_trains_only_the_completion():
    tok = Tokenizer.byte_level()
    few_shot = {"prompt": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                           {"role": "user", "content": "2+2"}],
                "completion": [{"role": "assistant", "content": "4"}]}
    ex = data.encode(tok, *data.to_messages(few_shot, "r"), "r")
    assert tok.decode(ex.tokens_n[ex.assistant_n], skip_special_tokens=False) == "4<|im_end|>"
    plain = data.encode(tok, *data.to_messages({"prompt": "Hi", "completion": "Yo"}, "r"), "r")
    assert tok.decode(plain.tokens_n, skip_special_tokens=False).startswith("<|im_start|>user\nHi")
    assert tok.decode(plain.tokens_n[plain.assistant_n], skip_special_tokens=False) == "Yo<|im_end|>"


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"role": "user", "content": "a"}, ', "not valid JSON"),
    ('{"prompt": "a"}', "missing key 'completion'"),
    ('{"completion": "a"}', "missing key 'prompt': a record needs 'messages', 'prompt' and 'completion', or 'text'"),
    ('{"text": ""}', "'text' must be a non-empty string"),
    ('{"text": ["a"]}', "'text' must be a non-empty string"),
    ('[1, 2]', "expected a JSON object"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object with string 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant turn"),
])
def test_a_bad_line_gives_one_error_naming_it(tmp_path, line, message):
    good = json.dumps({"prompt": "q", "completion": "a"})
    path = tmp_path / "train.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    settings = data.DataSettings(train_path=str(path), seq_len=64)
    with pytest.raises(ValueError, match=f"train.jsonl:3: .*{message}"):
        data.load_datasets(settings, Tokenizer.byte_level())


def test_text_records_train_every_token_and_end_with_one_eos(tmp_path):
    """TRL's language-modeling format: no chat template, EOS appended unless the text ends with it, all trained."""
    tok = Tokenizer.byte_level()
    ex = data.encode_record(tok, {"text": "2+2=4"}, "r")
    assert ex.tokens_n.tolist() == tok.encode("2+2=4", add_special_tokens=True) + [tok.eos_id]
    assert ex.assistant_n.all() and not ex.truncated
    ended = data.encode_record(tok, {"text": "2+2=4<|im_end|>"}, "r")  # already ends with EOS: not doubled
    assert ended.tokens_n.tolist() == ex.tokens_n.tolist()
    cut = data.encode_record(tok, {"text": "x" * 100}, "r", max_len=16)
    assert len(cut.tokens_n) == 16 and cut.truncated and cut.tokens_n[-1] != tok.eos_id
    # a file mixing the three formats: each record in its own format, the text one without a template
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"text": "plain words"}, {"prompt": "q", "completion": "a"},
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]})) + "\n")
    train, _, counts = data.load_datasets(data.DataSettings(train_path=str(path), seq_len=64), tok)
    assert counts["sft/examples"] == 3
    assert tok.decode(train[0].tokens_n, skip_special_tokens=False) == "plain words<|im_end|>"
    assert train[0].assistant_n.all() and not train[1].assistant_n.all()
    # packed next to a chat record, every text token after the first is a target, in order
    batch = packing.make_batch(train[:2], [[0, 1]], 64, tok.pad_id, num_rows=1)
    mask = batch.loss_mask_NxC[0]
    n_text = len(train[0].tokens_n)
    assert batch.targets_NxC[0][mask][:n_text - 1].tolist() == train[0].tokens_n[1:].tolist()


def test_missing_file_and_non_prefix_template_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl' does not exist"):
        data.read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        data.read_jsonl(tmp_path)
    latin1 = tmp_path / "latin1.jsonl"  # a Latin-1 file: one line valid, the next holds 0xe9
    latin1.write_bytes(b'{"prompt": "q", "completion": "a"}\n{"prompt": "caf\xe9", "completion": "a"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        data.read_jsonl(latin1)
    base = Tokenizer.byte_level()  # a template that renders only the last message: prefixes are not prefixes
    tok = Tokenizer(base.backend, eos_token="<|im_end|>",
                    chat_template="{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(ValueError, match=r"rec\[0\]: the chat template does not render turn 1"):
        data.tokenize(tok, [("rec[0]", {"prompt": "a", "completion": "b"})], 64)


def test_truncation_and_dropping_count():
    tok = Tokenizer.byte_level()
    long_prompt = {"prompt": "x" * 100, "completion": "y"}  # its answer starts past 64 tokens: dropped
    long_answer = {"prompt": "q", "completion": "z" * 100}  # cut inside the answer: kept, truncated
    ex, counts = data.tokenize(tok, [("a", long_prompt), ("b", long_answer)], 64)
    assert counts == {"sft/examples": 1, "sft/truncated": 1, "sft/dropped": 1}
    assert len(ex[0].tokens_n) == 64 and ex[0].truncated


def test_best_fit_decreasing_is_valid_and_near_optimal():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = list(rng.integers(1, 11, size=9))
        bins = packing.best_fit_decreasing(lengths, 10)
        assert sorted(itertools.chain(*bins)) == list(range(9))
        assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
        assert len(bins) <= 11 / 9 * -(-sum(lengths) // 10) + 6 / 9 + 1e-9
    # best fit (not first fit): 4 goes to the bin with 4 left, not the first with room (5 left)
    assert packing.best_fit_decreasing([5, 3, 7, 2, 4, 6], 10) == [[2, 1], [5, 4], [0, 3]]
    with pytest.raises(ValueError, match=r"\(index, length\) \[\(1, 11\)\]"):
        packing.best_fit_decreasing([3, 11], 10)


def test_step_rows_visit_every_row_once_per_epoch_and_repeat_by_step():
    seen = np.concatenate([packing.step_rows(10, 4, s, seed=3) for s in range(5)])  # 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    np.testing.assert_array_equal(packing.step_rows(10, 4, 3, seed=3), seen[12:16])
    assert not np.array_equal(packing.step_rows(10, 4, 0, seed=3), packing.step_rows(10, 4, 0, seed=4))


def test_held_out_fraction_and_inline_records():
    records = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(10)]
    settings = data.DataSettings(train_records=tuple(records), eval_fraction=0.2, seq_len=64, seed=1)
    train, held, counts = data.load_datasets(settings, Tokenizer.byte_level())
    assert (len(train), len(held)) == (8, 2) and counts["sft/examples_eval"] == 2
    tok = Tokenizer.byte_level()
    texts = {tok.decode(e.tokens_n) for e in train} | {tok.decode(e.tokens_n) for e in held}
    assert len(texts) == 10  # a split, not a copy
    again = data.load_datasets(settings, tok)[1]
    assert [tok.decode(e.tokens_n) for e in again] == [tok.decode(e.tokens_n) for e in held]  # seeded


@pytest.mark.parametrize("lengths,scored,rows,width,want", [
    ([10, 20, 5], [3, 4, 1], [[0], [1], [2]], 96, (32, 16)),   # longest row 20 -> 32, most scored 4 -> 16
    ([10, 20, 5], [3, 4, 1], [[0, 1], [2]], 96, (32, 16)),     # a packed row: 30 tokens, 7 scored
    ([40, 50], [30, 45], [[0], [1]], 52, (52, 48)),            # rounding stops at the width
    ([16], [16], [[0]], 96, (16, 16)),                         # exactly one bucket
])
def test_batch_shape_is_the_longest_row_and_most_scored_rounded_up(lengths, scored, rows, width, want):
    examples = [data.Example(np.arange(n, dtype=np.int32), np.r_[np.zeros(n - k, bool), np.ones(k, bool)], False)
                for n, k in zip(lengths, scored)]
    assert packing.batch_shape(examples, rows, width) == want
    L, C = want
    batch = packing.make_batch(examples, rows, L, 0, slots=C)
    assert batch.tokens_RxL.shape == (len(rows), L) and batch.targets_NxC.shape == (len(rows), C)
    with pytest.raises(ValueError, match=r"score \d+ \(slots 0\)"):
        packing.make_batch(examples, [[0]], L, 0, slots=0)
