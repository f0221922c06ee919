"""bench/rollout.py helpers that need no model: the decode-width bookkeeping behind its matmul floor, the random
prompts of --prompt-len (its --quick run: tests/bench/test_quick_modes.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from rollout import decode_widths, make_prompts, until_stop  # noqa: E402


def test_decode_widths_follow_the_samplers_shrink_rule():
    # token 0 comes from the prefill; the step for token t runs while a row has length > t
    assert decode_widths([2, 5, 5, 1], 4, 6, ()) == {4: 4}
    assert decode_widths([2, 5, 5, 1], 4, 6, (2,)) == {4: 1, 2: 3}   # 2 rows left after token 1: width 2
    assert decode_widths([6, 6, 6, 6], 4, 6, (2,)) == {4: 5}          # nobody stops: never shrinks
    assert decode_widths([1, 1, 1, 1], 4, 6, (2,)) == {}              # all stop at the first token
    assert decode_widths([3, 3], 2, 6, (8, 1)) == {2: 2}              # widths >= N are ignored


def test_until_stop_keeps_the_stop_token():
    assert until_stop([5, 9, 2, 2, 7], {2}) == [5, 9, 2]
    assert until_stop([5, 9], {2}) == [5, 9]


def test_random_prompts_have_the_length_and_no_stop_or_pad_token():
    from posttrain.model.tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    prompts = make_prompts(tok, 6, length=40, vocab_size=tok.vocab_size)
    assert len(prompts) == 6 and {len(p) for p in prompts} == {40}
    ids = {i for p in prompts for i in p}
    assert not ids & {*tok.stop_ids, tok.pad_id} and max(ids) < tok.vocab_size and len(ids) > 40
    assert prompts == make_prompts(tok, 6, length=40, vocab_size=tok.vocab_size)  # seeded
