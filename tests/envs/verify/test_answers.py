"""Tests for envs/verify/answers.py: extraction, normalisation, equivalence, unit-test scoring, formats."""
import dataclasses
import threading

import pytest

from envs.verify import answers
def test_hash_answer_is_found_anywhere_in_a_long_response():
    response = "2+40=42\n#### 42\n" + "x" * 400
    verdict = answers.score_math(response, "42")
    assert verdict.reward == 1.0 and verdict.method == "hash" and verdict.extracted == "42"


def test_last_hash_line_wins():
    assert answers.extract_hash_answer("#### 3\nno wait\n#### 4") == "4"
    assert answers.extract_hash_answer("####   \n") is None


@pytest.mark.parametrize("text,expected", [
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"\boxed{2^{10}}", "2^{10}"),
    (r"\fbox{42}", "42"),
    (r"\boxed{C} then \boxed{E}", "E"),
    (r"\boxed{12", None),
    (r"\boxed{5} and later \boxed{7", None),
    ("no box here", None),
])
def test_extract_boxed(text, expected):
    assert answers.extract_boxed(text) == expected


def test_boxed_answer_is_stripped_exactly_once():
    verdict = answers.score_math(r"Answer: \boxed{5}", "5")
    assert verdict.reward == 1.0 and verdict.extracted == "5" and verdict.method == "boxed"
    assert answers.score_math(r"Answer: \boxed{5}", "6").reward == 0.0


def test_unclosed_box_scores_zero_with_reason_instead_of_falling_back():
    verdict = answers.score_math(r"so the answer is \boxed{12", "12")
    assert verdict.reward == 0.0 and "unclosed" in verdict.reason


def test_hash_takes_priority_over_box_and_last_number():
    assert answers.extract_answer(r"\boxed{3} ... #### 4 and 5")[:2] == ("4 and 5", "hash")
    assert answers.extract_answer(r"\boxed{3} then 9")[:2] == ("3", "boxed")


@pytest.mark.parametrize("text,expected", [
    ("The answer is 122.", "122"), ("-7 degrees", "-7"), ("it costs 1,234.50 total", "1,234.50"),
    ("no digits", None), ("", None)])
def test_last_number(text, expected):
    assert answers.last_number(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("59 + 63 = 122", 122), ("The answer is -4.", -4), ("none", None), ("12.5", 5), (None, None)])
def test_last_integer(text, expected):
    assert answers.last_integer(text) == expected


@pytest.mark.parametrize("raw,normal", [
    ("$1,234.00", "1234"), ("42 dollars", "42"), ("42 apples", "42 apples"), ("5\\text{ cm}", "5"), ("50%", "50"), ("\\$18", "18"),
    ("3.50", "3.5"), ("**18**", "18"), ("`7`", "7"), ("5 km/h", "5"), ("122.", "122"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("-0.0", "0")])
def test_normalize_answer(raw, normal):
    assert answers.normalize_answer(raw) == normal


@pytest.mark.parametrize("pred,gold,same", [
    ("$1,234.00", "1234", True), ("0.5", "\\frac{1}{2}", True), ("42 dollars", "42", True), ("42 apples", "42", False),
    ("2^{10}", "1024", True), ("\\sqrt{4}", "2", True), ("x+1", "1+x", True), ("E", "E", True),
    ("E", "C", False), ("0.33", "\\frac{1}{3}", False), ("43", "42", False), ("1/0", "1", False)])
def test_answers_equivalent(pred, gold, same):
    assert answers.answers_equivalent(pred, gold) is same


def test_equivalence_works_off_the_main_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(answers.answers_equivalent("2^{10}", "1024")))
    thread.start()
    thread.join()
    assert out == [True]


@pytest.mark.parametrize("response", ["", "   ", None, 42, "\\boxed{", "####", "}}}{{{", "\x00\xff"])
def test_malformed_output_scores_zero_with_reason(response):
    verdict = answers.score_math(response, "5")
    assert verdict.reward == 0.0 and verdict.status == "wrong" and verdict.reason


def test_gold_answer():
    assert answers.gold_answer("so 9 * 2 = 18\n#### 18") == "18"
    assert answers.gold_answer(" 122 ") == "122"
    with pytest.raises(ValueError, match="empty"):
        answers.gold_answer("####")


def test_check_format_pairs_tags():
    assert answers.check_format("<think>a</think>\n<answer>5</answer>") == (True, "")
    ok, reason = answers.check_format("<think>...</tool><answer>5</answer>")
    assert not ok and "</tool>" in reason
    assert not answers.check_format("<think>a</think>")[0]
    assert not answers.check_format("<answer>5</answer><think>a</think>")[0]
    assert not answers.check_format("hi <think>a</think><answer>5</answer>")[0]
    assert not answers.check_format("<think>a<answer>5</answer>")[0]
    assert answers.extract_tag("<think>a</think><answer> 5 </answer>", "answer") == "5"


def test_extract_code_blocks():
    text = "x\n```python\nprint(1)\n```\n```bash\nls\n```\n```\nraw\n```\n```python\nunclosed"
    assert answers.extract_code_blocks(text) == ["print(1)\n"]
    assert answers.extract_code_blocks(text, ("bash", "sh")) == ["ls\n"]
    assert answers.extract_code_blocks(text, ("",)) == ["raw\n"]


@dataclasses.dataclass
class FakeResult:
    status: str
    returncode: int | None = None
    stderr: str = ""
    reason: str = ""
    stdout: str = ""


@pytest.mark.parametrize("result,reward,status", [
    (FakeResult("ok", 0), 1.0, "ok"),
    (FakeResult("runtime_error", 1, "Traceback...\nAssertionError: x"), 0.0, "wrong"),
    (FakeResult("runtime_error", 1, "Traceback...\nNameError: y"), 0.0, "runtime_error"),
    (FakeResult("ok", 1, "ZeroDivisionError"), 0.0, "runtime_error"),
    (FakeResult("timeout", None, reason="wall"), 0.0, "timeout"),
    (FakeResult("memory_limit", -9), 0.0, "memory_limit"),
    (FakeResult("infra_error", None, reason="bwrap missing"), 0.0, "infra_error"),
    (FakeResult("bogus", 0), 0.0, "infra_error"),
])
def test_score_unit_tests(result, reward, status):
    verdict = answers.score_unit_tests(result)
    assert (verdict.reward, verdict.status) == (reward, status)


def test_methods_restrict_extraction():
    assert answers.score_math("The answer is 5", "5", methods=("boxed",)).reward == 0.0
    assert answers.score_math("#### 4 but \\boxed{5}", "5", methods=("boxed",)).reward == 1.0
    with pytest.raises(ValueError, match="methods"):
        answers.score_math("5", "5", methods=("guess",))


@pytest.mark.parametrize("expr", ["9^{9^{9^{9}}}", "10^{10^{10}}", "2^{99999}", "100000!", "(10^{100000})!",
                                  "2**2**40", "1+" * 200 + "1", "(9^{99})!", "x!", "2^3^4", "e^{9^{9^{9}}}",
                                  "2^{(9^{9})}", "9^{9}^{9}", "2^{-3^{40}}", "2**(3)**40"])
def test_costly_expressions_are_refused_quickly_even_off_the_main_thread(expr):
    import time

    assert answers.too_costly(expr)
    out, start = [], time.perf_counter()
    thread = threading.Thread(target=lambda: out.append(answers.answers_equivalent(expr, "18")))
    thread.start()
    thread.join(timeout=10)
    assert out == [False] and time.perf_counter() - start < 2.0
    assert not any(answers.too_costly(e) for e in ("2^{10}", "\\frac{1}{3}", "5!", "x != 3", "120", "x^2+y^2", "(x+1)^2",
                                             "e^{x^{2}}", "2^{n^2}", "2^{3}+x^{2}", "10^{2}\\cdot 10^{3}"))


@pytest.mark.parametrize("pred,gold,same", [  # several separate powers are compared, not refused
    ("x^2+y^2", "y^2+x^2", True), ("x^2+y^2", "y^2+x^3", False), ("(x+1)^2", "x^2+2x+1", True),
    ("a^{2}+b^{2}+c^2", "c^2+b^2+a^2", True), ("2^{10}+2^{3}", "1032", True), ("x^2y^2", "(xy)^2", True),
    ("e^{x^{2}}", "e^{x^2}", True), ("e^{-x^{2}}", "e^{-x^2}", True), ("e^{x^{2}}", "e^{x^3}", False),  # symbolic towers
    ("2^{n^2}", "2^{n^{2}}", True), ("e^x^2", "e^{x^2}", True), ("x^{y^{z}}", "x^{y^{z}}+0", True)])
def test_separate_powers_are_compared(pred, gold, same):
    assert answers.answers_equivalent(pred, gold) is same


# --- numerals written with Unicode signs, digits or spaces ---------------------------------------
@pytest.mark.parametrize("response,gold,reward", [
    ("The answer is \u22127", "7", 0.0), ("The answer is \u22127", "-7", 1.0),  # U+2212 MINUS SIGN
    ("#### \u201212", "-12", 1.0), ("#### \u27963", "-3", 1.0), ("#### \uff0d5", "-5", 1.0),  # figure dash, heavy, full-width
    ("#### \ufe635", "-5", 1.0), ("it is \u20134 degrees", "-4", 1.0), ("pages 3\u20135", "5", 1.0),  # en dash: sign vs range
    ("#### \uff14\uff12", "42", 1.0), ("#### \u0664\u0662", "42", 1.0), ("#### \u0967\u0968", "12", 1.0),  # full-width, Arabic, Devanagari
    ("#### 1\u2009234", "1234", 1.0), ("#### 1\u00a0234\u00a0567", "1234567", 1.0), ("#### 1\u202f234", "1234", 1.0),
    ("the total is 1\u2009234 apples", "1234", 1.0), ("#### 1\u200b2", "12", 1.0), ("#### \u00a07", "7", 1.0),
    (r"\boxed{2⁵}", "32", 1.0), (r"\boxed{10⁻³}", "0.001", 1.0), (r"\boxed{x²+1}", "x^2+1", 1.0),
    ("#### ½", "0.5", 1.0), ("#### 3½", "3.5", 1.0), ("#### 3½", "31/2", 0.0), ("\\boxed{\u22121/2}", "-0.5", 1.0),
    (r"\boxed{¹⁄₂}", "0.5", 1.0), ("#### 1¹⁄₁₆", "1.0625", 1.0), ("#### 1¹⁄₁₆", "11/16", 0.0),  # super/sub fractions
])
def test_unicode_numerals_are_normalised_before_extraction_and_comparison(response, gold, reward):
    assert answers.score_math(response, gold).reward == reward


@pytest.mark.parametrize("raw,ascii_", [
    ("\u22127", "-7"), ("\uff17", "7"), ("1\u2009000", "1000"), ("x\u00b2", "x^{2}"), ("10\u207b\u00b3", "10^{-3}"),
    ("a\u2082", "a_{2}"), ("\u00bd", "\\frac{1}{2}"), ("¹⁄₁₆", "\\frac{1}{16}"), ("3¹⁵⁄₁₆", "3+\\frac{15}{16}"),
    ("x²⁄₃", "x^{2}/_{3}"), ("2\u00d73", "2\\times 3"), ("3\u00a0apples", "3 apples"),
    ("plain ascii - 7", "plain ascii - 7")])
def test_normalize_unicode(raw, ascii_):
    assert answers.normalize_unicode(raw) == ascii_


def test_unicode_is_normalised_everywhere():
    assert answers.last_integer("it is \u22124") == -4 and answers.gold_answer("#### \u22127") == "-7"
    assert answers.answers_equivalent("\u22127", "-7") and answers.normalize_answer("\uff14\uff12") == "42"
    with pytest.raises(TypeError, match="str"):
        answers.normalize_unicode(7)


# --- item 2: stripping units never deletes a variable, constant or the imaginary unit ----------------
@pytest.mark.parametrize("response,gold,reward", [
    ("The answer is \\boxed{3x}.", "3", 0.0), (r"\boxed{7i}", "7", 0.0), (r"\boxed{2e}", "2", 0.0),
    (r"\boxed{3\pi}", "3", 0.0), (r"\boxed{5m}", "5", 0.0), (r"\boxed{4 s}", "4", 0.0), ("#### 5 l", "5", 0.0),
    ("#### 3x", "3", 0.0), ("#### 3 i", "3", 0.0), (r"\boxed{3x}", "3x", 1.0), (r"\boxed{7i}", "7i", 1.0),
    ("#### 18 dollars", "18", 1.0), ("#### $18", "18", 1.0), ("#### 50%", "50", 1.0), (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0), ("#### 5 cm", "5", 1.0), ("#### 12 km/h", "12", 1.0),
    (r"\boxed{30^\circ}", "30", 1.0), ("#### 3 hours", "3", 1.0), (r"\boxed{4\,\mathrm{kg}}", "4", 1.0),
    (r"\boxed{\frac{1}{2}\text{ cm}}", "0.5", 1.0), ("#### 42 apples", "42", 0.0),  # not a unit of the list
    (r"\boxed{6 \text{ cm}^2}", "6", 1.0), (r"\boxed{4\mbox{ inches}^{3}}", "4", 1.0), (r"\boxed{5 \mathrm{~cm}}", "5", 1.0),
    ("#### 5~cm", "5", 1.0), (r"\boxed{9\text{ square units}}", "9", 1.0), (r"\boxed{3 \text{ m}^2}", "3", 0.0),
    (r"\boxed{2x^2}", "2", 0.0), (r"\boxed{2x^2}", "2x^2", 1.0),
])
def test_only_listed_units_are_stripped(response, gold, reward):
    assert answers.score_math(response, gold).reward == reward


@pytest.mark.parametrize("raw,stripped", [
    ("3x", "3x"), ("7i", "7i"), ("2e", "2e"), ("5 m", "5 m"), ("dollars", "dollars"), ("3xcm", "3xcm"),
    ("42 dollars", "42"), ("5cm", "5"), ("5 \\text{cm}", "5"), ("50\\%", "50"), ("12 m/s", "12"),
    ("6\\text{ cm}^2", "6"), ("6\\text{ cm}^{2}", "6"), ("5\\mathrm{~cm}", "5"), ("5~cm", "5"), ("3\\text{ m}^2", "3\\text{ m}^2"),
    ("x^2", "x^2"), ("2^3", "2^3")])
def test_strip_unit(raw, stripped):
    assert answers.strip_unit(raw) == stripped
    assert all(len(u) > 1 for u in answers.UNITS if u.isalpha())  # no single letter is a unit


# --- item 3: exact answers compare exactly, tolerance only for decimal approximations ----------------
@pytest.mark.parametrize("pred,gold,same", [
    (r"\frac{1}{2^{98}}", r"\frac{1}{2^{99}}", False), ("10^{-20}", r"2\cdot 10^{-20}", False),
    (r"2\cdot 10^{-20}", r"2\cdot 10^{-20}", True), (r"\frac{1}{3}", r"\frac{1}{3} + 10^{-30}", False),
    ("x+10^{-30}", "x", False), (r"(10^{-20}, 1)", r"(2\cdot10^{-20}, 1)", False),
    (r"\{10^{-20}, 1\}", r"\{1, 2\cdot 10^{-20}\}", False), (r"\{1,2\}", r"\{2,1\}", True),
    ("1234567.5", "1234567", False), ("2.0000001", "2", False), ("0.1", r"\frac{1}{10}", True), ("3.0", "3", True),
    ("0.3333333", r"\frac{1}{3}", True), ("0.6666667", r"\frac{2}{3}", True), ("0.33", r"\frac{1}{3}", False),
    ("1.414214", r"\sqrt{2}", True), ("3.14", r"\pi", False), (r"\sqrt{8}", r"2\sqrt{2}", True),
    ("3+4i", "4i+3", True), ("1/0", "1", False),
])
def test_exact_answers_compare_exactly(pred, gold, same):
    assert answers.answers_equivalent(pred, gold) is same


# --- item 5: extraction is linear in the response; long answers are refused --------------------------
SHAPES = {  # response of about n chars, in shapes that made regexes quadratic
    "spaces": lambda n: "#### 1" + " " * n + "x", "tabs": lambda n: "\t" * n + "7", "digits": lambda n: "1" * n,
    "commas": lambda n: "1," * (n // 2), "braces": lambda n: r"\boxed{" + "{" * (n // 2) + "}" * (n // 2) + "}",
    "text": lambda n: r"\boxed{5" + r"\text{" * (n // 6) + "}", "hashes": lambda n: "#### " * (n // 5),
    "boxes": lambda n: r"\boxed{1}" * (n // 9), "unit_tail": lambda n: "#### 5" + " " * n + r"\text{ cm}",
    "unicode": lambda n: "\u2212\u2009" * (n // 2) + "\uff17", "think": lambda n: "<think>" + "9 " * (n // 2),
}


def _best_time(fn, repeats=3):
    import time

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scoring_time_is_linear_in_the_response(shape):
    small, big = SHAPES[shape](100_000), SHAPES[shape](1_000_000)
    t_small = _best_time(lambda: answers.score_math(small, "42"))
    t_big = _best_time(lambda: answers.score_math(big, "42"))
    assert t_big < 1.0 and t_big / max(t_small, 5e-3) < 20, (shape, t_small, t_big)  # below 5 ms is noise


def test_answers_longer_than_the_cap_are_refused_before_comparison():
    long_answer = "1+" * (answers.MAX_ANSWER_CHARS // 2) + "1"
    verdict = answers.score_math(f"#### {long_answer}", "42")
    assert (verdict.reward, verdict.status) == (0.0, "wrong") and "MAX_ANSWER_CHARS" in verdict.reason
    assert len(verdict.extracted) == answers.MAX_ANSWER_CHARS + 3  # shown truncated
    assert answers.score_math(r"\boxed{" + "1" * (answers.MAX_ANSWER_CHARS + 5) + "}", "1").reason.startswith("\\boxed{} content")
    assert answers.compare_answers("7" * (answers.MAX_ANSWER_CHARS + 1), "7") == (
        False, f"answer of {answers.MAX_ANSWER_CHARS + 1} chars is longer than MAX_ANSWER_CHARS={answers.MAX_ANSWER_CHARS}")


TEXT_SHAPES = {  # the other readers of model text (code envs, tags, format reward)
    "open_tags": lambda n: "<answer>" * (n // 8), "open_tags_closed": lambda n: "<answer>" * (n // 8) + "</answer>",
    "open_fences": lambda n: "```python\n" * (n // 10), "nested_think": lambda n: "<think>" * (n // 7),
    "lt": lambda n: "<answer>" + "<" * n,
}


@pytest.mark.parametrize("reader", ["extract_tag", "extract_code_blocks", "check_format"])
@pytest.mark.parametrize("shape", sorted(TEXT_SHAPES))
def test_tag_fence_and_format_readers_are_linear(reader, shape):
    fn = (lambda t: answers.extract_tag(t, "answer")) if reader == "extract_tag" else getattr(answers, reader)
    small, big = TEXT_SHAPES[shape](100_000), TEXT_SHAPES[shape](1_000_000)
    t_small, t_big = _best_time(lambda: fn(small), 5), _best_time(lambda: fn(big), 5)
    assert t_big < 1.0 and t_big / max(t_small, 5e-3) < 40, (reader, shape, t_small, t_big)  # below 5 ms is noise
    # (a quadratic reader takes 100x for 10x the text; a linear one took up to 22x beside the suite's other worker)


@pytest.mark.parametrize("text,expected", [  # same answer as the last match of <tag>(.*?)</tag> over the text
    ("<answer>1</answer><answer>2</answer>", "2"), ("<answer>1</answer>x</answer>", "1"), ("<answer>1<answer>2</answer>", "1<answer>2"),
    ("<answer> 5 </answer><answer>", "5"), ("<answer>5", None), ("5</answer>", None), ("", None), (None, None)])
def test_extract_tag(text, expected):
    assert answers.extract_tag(text, "answer") == expected


@pytest.mark.parametrize("text", ["a 1,234 b 5", "x -3.5", "1,234,567", "3-5", "12,34", ".5 and 7.", "1.2.3"])
def test_last_number_matches_the_whole_text_regex(text):
    import re

    matches = re.findall(answers.NUMBER, text)
    assert answers.last_number(text) == (matches[-1] if matches else None)


# --- item 9: reasoning traces ------------------------------------------------------------------------
@pytest.mark.parametrize("response,gold,tags,reward", [
    ("<think>maybe 41? or 42?</think>The answer is 7", "7", answers.THINK_TAGS, 1.0),
    ("<think>maybe 41? or 42?</think>The answer is 7", "42", answers.THINK_TAGS, 0.0),
    ("<think>#### 42</think>#### 7", "7", answers.THINK_TAGS, 1.0),
    ("<think>\\boxed{42}</think> so it is 7", "42", answers.THINK_TAGS, 0.0),
    ("<think>the answer is 42", "42", answers.THINK_TAGS, 0.0),  # cut off while thinking: no answer
    ("<think>a</think><think>42</think>", "42", answers.THINK_TAGS, 0.0),
    ("<think>42</think>", "42", None, 1.0),  # turned off
    ("<reasoning>42</reasoning> 7", "7", ("<reasoning>", "</reasoning>"), 1.0),
    ("no trace, 42", "42", answers.THINK_TAGS, 1.0),
])
def test_answer_is_read_after_the_last_think_tag(response, gold, tags, reward):
    assert answers.score_math(response, gold, think_tags=tags).reward == reward


def test_bad_think_tags_and_timeout_are_one_clear_error():
    with pytest.raises(ValueError, match="reasoning tags"):
        answers.score_math("42", "42", think_tags=("<think>",))
    with pytest.raises(ValueError, match="timeout_s"):
        answers.score_math("42", "42", timeout_s=0)
