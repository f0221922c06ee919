"""The extension-break rule (issue 25 item 5, acceptance 3): a table of chat-template cases on the byte tokenizer
(no download): Qwen3's real template (tests/golden/qwen3_chat_template.jinja) strips a reply's `<think>` block
once a user turn follows and rewrites its whitespace before a tool result, a template that trims message content
drops trailing whitespace, a reply spelled in other tokens than the text encodes to re-renders as other tokens,
while tool results after a plain reply, a think block already in the template's spelling and the plain ChatML
template extend exactly. A break splits the sample (the part so far exactly as sampled, the next part prompted
by the whole rendering) and is counted; the token-append path's check raises naming the first difference.
"""
import pathlib

import numpy as np
import pytest

from posttrain.model.tokenizer import Tokenizer
from posttrain.rollout.episodes import Sample
from posttrain.rollout.turns import TurnTokens, assert_extends, break_metrics, extends

BYTES = Tokenizer.byte_level()
QWEN3 = Tokenizer(BYTES.backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=(
    pathlib.Path(__file__).resolve().parents[2] / "golden" / "qwen3_chat_template.jinja").read_text())
TRIM = Tokenizer(BYTES.backend, eos_token="<|im_end|>", chat_template=(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
USER = [{"role": "user", "content": "What is 2 + 3?"}]
FOLLOW_UP = [{"role": "user", "content": "And times 4?"}]
TOOL = [{"role": "tool", "content": "5"}]
THINK_QWEN = "<think>\nadd them\n</think>\n\nIt is 5."  # the template's own spelling of a think block

CASES = [  # (name, tokenizer, reply text, reply spelled byte by byte, the next messages, breaks)
    ("qwen3-think-stripped-at-next-user-turn", QWEN3, THINK_QWEN, False, FOLLOW_UP, 1),
    ("qwen3-think-whitespace-rewritten-before-tool-result", QWEN3, "<think>add them</think>It is 5.", False, TOOL, 1),
    ("qwen3-think-in-template-spelling-then-tool-result", QWEN3, THINK_QWEN, False, TOOL, 0),
    ("qwen3-tool-result-after-plain-reply", QWEN3, "<tool_call>add</tool_call>", False, TOOL, 0),
    ("trim-template-drops-trailing-whitespace", TRIM, "It is 5.  \n", False, FOLLOW_UP, 1),
    ("trim-template-reply-without-whitespace", TRIM, "It is 5.", False, FOLLOW_UP, 0),
    ("chatml-keeps-the-reply", BYTES, "It is 5.  \n", False, FOLLOW_UP, 0),
    ("reply-in-other-tokens-than-its-text-encodes-to", BYTES, "It is <|endoftext|> 5.", True, FOLLOW_UP, 1),
]


def _reply_ids(tok, text, byte_by_byte):
    """The tokens the policy produced for `text` and its end-of-turn token; byte_by_byte: a special token's text
    spelled as bytes (decodes to the same text, encodes back to the special token)."""
    ids = [b for b in text.encode()] if byte_by_byte else tok.encode(text)
    return ids + [tok.eos_id]


@pytest.mark.parametrize("name,tok,reply,bytewise,new,breaks", CASES, ids=[c[0] for c in CASES])
def test_extension_break_rule_table(name, tok, reply, bytewise, new, breaks):
    prompt = tok.encode(tok.apply_chat_template(USER, add_generation_prompt=True))
    reply_ids = _reply_ids(tok, reply, bytewise)
    rec = TurnTokens.start(prompt)
    rec.add_reply(reply_ids, -np.ones(len(reply_ids)))
    assert rec.context() == prompt + reply_ids
    rendered = tok.encode(tok.apply_chat_template(USER + [{"role": "assistant", "content": reply}] + new,
                                                  add_generation_prompt=True))
    assert rec.next_prompt(rendered) == rendered and rec.breaks == breaks
    if breaks:  # the part so far stays exactly as sampled; the next one is prompted by the whole rendering
        assert len(rec.parts) == 2 and rec.parts[1] == (rendered, [])
        assert rec.parts[0][0] == prompt and [s[0].tolist() for s in rec.parts[0][1]] == [reply_ids]
        with pytest.raises(AssertionError, match="does not extend the sample's"):
            assert_extends(prompt + reply_ids, rendered)
    else:  # one part: the rendering's new tokens are a masked bridge
        (_, segments), = rec.parts
        assert [pol for _, _, pol in segments] == [True, False] and rec.context() == rendered
        assert not segments[1][1].any() and extends(prompt + reply_ids, rendered)


def test_split_episode_to_samples_and_counts():
    """3 turns on Qwen3 with a user follow-up after a thinking reply (a break) and a tool result after a plain
    one (an extension): 2 samples, each with the episode's reward and group, the trailing bridge dropped; the
    breaks summed over episodes."""
    msgs = list(USER)
    rec = TurnTokens.start(QWEN3.encode(QWEN3.apply_chat_template(msgs, add_generation_prompt=True)))
    for reply, new in ((THINK_QWEN, FOLLOW_UP), ("<tool_call>mul</tool_call>", TOOL), ("20", FOLLOW_UP)):
        ids = _reply_ids(QWEN3, reply, False)
        rec.add_reply(ids, np.full(len(ids), -0.5))
        msgs += [{"role": "assistant", "content": reply}] + new
        rec.next_prompt(QWEN3.encode(QWEN3.apply_chat_template(msgs, add_generation_prompt=True)))
    assert rec.breaks == 1 and len(rec.parts) == 2
    episode = Sample(domain="math", group=3, prompt_ids=[], reward=1.0, status="ok", done=True)
    first, second = rec.to_samples(episode)
    assert [s.group for s in (first, second)] == [3, 3] and first.reward == second.reward == 1.0
    assert [p for _, _, p in first.segments] == [True]  # its reply; the break's rendering is not its bridge
    assert [p for _, _, p in second.segments] == [True, False, True]  # reply, tool-result bridge, reply
    assert second.prompt_ids == rec.parts[1][0] and first.completion_len + second.completion_len > 0
    assert break_metrics([rec, TurnTokens.start([1])]) == {"rollout/extension_breaks": 1.0}
    with pytest.raises(ValueError, match="first prompt has no tokens"):
        TurnTokens.start([])
    with pytest.raises(ValueError, match="must be equal 1-D"):
        rec.add_reply([1, 2], [0.0])
