"""Tagged answers (`envs.verify.tagged`): the one tag extractor after the reasoning block, the last-line fallback."""
import pytest

from envs.verify import tagged


def test_fallback_reads_only_the_last_line_and_never_a_long_one():
    assert tagged.fallback_answer("The answer is 3.\nThen I doubled it.") == (None, "none")
    assert tagged.fallback_answer("x " * tagged.FALLBACK_MAX_LINE + "= 4") == (None, "none")
    assert tagged.read_answer(None) == (None, "none")


@pytest.mark.parametrize("reply,expected", [
    ("<think><answer>1</answer></think>\n<answer>\n2\n</answer>", ("2", "answer_tag")),  # after the reasoning
    ("<answer>1</answer> then <answer> 3 </answer>", ("3", "answer_tag")),  # the last tag, stripped
    ("<answer>a\nb</answer>", ("a\nb", "answer_tag")),  # multi-line kept
    ("<answer>5", (None, "none")),  # an unclosed tag is not read by the fallback either
    ("<think>x</think> The answer is 7.", ("7", "fallback_phrase")),
])
def test_read_answer_uses_the_one_tag_extractor(reply, expected):
    assert tagged.read_answer(reply) == expected
