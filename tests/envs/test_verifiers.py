"""Tests for envs/verifiers.py: extraction, normalisation, equivalence, unit-test scoring, formats."""
import dataclasses
import threading

import pytest

from envs import verifiers as v


def test_hash_answer_is_found_anywhere_in_a_long_response():
    response = "2+40=42\n#### 42\n" + "x" * 400
    verdict = v.score_math(response, "42")
    assert verdict.reward == 1.0 and verdict.method == "hash" and verdict.extracted == "42"


def test_last_hash_line_wins():
    assert v.extract_hash_answer("#### 3\nno wait\n#### 4") == "4"
    assert v.extract_hash_answer("####   \n") is None


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
    assert v.extract_boxed(text) == expected


def test_boxed_answer_is_stripped_exactly_once():
    verdict = v.score_math(r"Answer: \boxed{5}", "5")
    assert verdict.reward == 1.0 and verdict.extracted == "5" and verdict.method == "boxed"
    assert v.score_math(r"Answer: \boxed{5}", "6").reward == 0.0


def test_unclosed_box_scores_zero_with_reason_instead_of_falling_back():
    verdict = v.score_math(r"so the answer is \boxed{12", "12")
    assert verdict.reward == 0.0 and "unclosed" in verdict.reason


def test_hash_takes_priority_over_box_and_last_number():
    assert v.extract_answer(r"\boxed{3} ... #### 4 and 5")[:2] == ("4 and 5", "hash")
    assert v.extract_answer(r"\boxed{3} then 9")[:2] == ("3", "boxed")


@pytest.mark.parametrize("text,expected", [
    ("The answer is 122.", "122"), ("-7 degrees", "-7"), ("it costs 1,234.50 total", "1,234.50"),
    ("no digits", None), ("", None)])
def test_last_number(text, expected):
    assert v.last_number(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("59 + 63 = 122", 122), ("The answer is -4.", -4), ("none", None), ("12.5", 5), (None, None)])
def test_last_integer(text, expected):
    assert v.last_integer(text) == expected


@pytest.mark.parametrize("raw,normal", [
    ("$1,234.00", "1234"), ("42 apples", "42"), ("5\\text{ cm}", "5"), ("50%", "50"), ("\\$18", "18"),
    ("3.50", "3.5"), ("**18**", "18"), ("`7`", "7"), ("5 km/h", "5"), ("122.", "122"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("-0.0", "0")])
def test_normalize_answer(raw, normal):
    assert v.normalize_answer(raw) == normal


@pytest.mark.parametrize("pred,gold,same", [
    ("$1,234.00", "1234", True), ("0.5", "\\frac{1}{2}", True), ("42 apples", "42", True),
    ("2^{10}", "1024", True), ("\\sqrt{4}", "2", True), ("x+1", "1+x", True), ("E", "E", True),
    ("E", "C", False), ("0.33", "\\frac{1}{3}", False), ("43", "42", False), ("1/0", "1", False)])
def test_answers_equivalent(pred, gold, same):
    assert v.answers_equivalent(pred, gold) is same


def test_equivalence_works_off_the_main_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(v.answers_equivalent("2^{10}", "1024")))
    thread.start()
    thread.join()
    assert out == [True]


@pytest.mark.parametrize("response", ["", "   ", None, 42, "\\boxed{", "####", "}}}{{{", "\x00\xff"])
def test_malformed_output_scores_zero_with_reason(response):
    verdict = v.score_math(response, "5")
    assert verdict.reward == 0.0 and verdict.status == "wrong" and verdict.reason


def test_gold_answer():
    assert v.gold_answer("so 9 * 2 = 18\n#### 18") == "18"
    assert v.gold_answer(" 122 ") == "122"
    with pytest.raises(ValueError, match="empty"):
        v.gold_answer("####")


def test_check_format_pairs_tags():
    assert v.check_format("<think>a</think>\n<answer>5</answer>") == (True, "")
    ok, reason = v.check_format("<think>...</tool><answer>5</answer>")
    assert not ok and "</tool>" in reason
    assert not v.check_format("<think>a</think>")[0]
    assert not v.check_format("<answer>5</answer><think>a</think>")[0]
    assert not v.check_format("hi <think>a</think><answer>5</answer>")[0]
    assert not v.check_format("<think>a<answer>5</answer>")[0]
    assert v.extract_tag("<think>a</think><answer> 5 </answer>", "answer") == "5"


def test_extract_code_blocks():
    text = "x\n```python\nprint(1)\n```\n```bash\nls\n```\n```\nraw\n```\n```python\nunclosed"
    assert v.extract_code_blocks(text) == ["print(1)\n"]
    assert v.extract_code_blocks(text, ("bash", "sh")) == ["ls\n"]
    assert v.extract_code_blocks(text, ("",)) == ["raw\n"]


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
    verdict = v.score_unit_tests(result)
    assert (verdict.reward, verdict.status) == (reward, status)


def test_methods_restrict_extraction():
    assert v.score_math("The answer is 5", "5", methods=("boxed",)).reward == 0.0
    assert v.score_math("#### 4 but \\boxed{5}", "5", methods=("boxed",)).reward == 1.0
    with pytest.raises(ValueError, match="methods"):
        v.score_math("5", "5", methods=("guess",))


def test_success_marker_is_required_when_given():
    marker = "c0ffee"
    assert v.score_unit_tests(FakeResult("ok", 0, stdout=f"hi\n{marker}\n"), marker).reward == 1.0
    early = v.score_unit_tests(FakeResult("ok", 0, stdout="hi\n"), marker)
    assert (early.reward, early.status) == (0.0, "wrong") and "before the tests" in early.reason
    assert v.score_unit_tests(FakeResult("ok", 0, stdout=f"{marker}\nmore"), marker).reward == 0.0


@pytest.mark.parametrize("expr", ["9^{9^{9^{9}}}", "10^{10^{10}}", "2^{99999}", "100000!", "(10^{100000})!",
                                  "2**2**40", "1+" * 200 + "1", "(9^{99})!", "x!"])
def test_costly_expressions_are_refused_quickly_even_off_the_main_thread(expr):
    import time

    assert v.too_costly(expr)
    out, start = [], time.perf_counter()
    thread = threading.Thread(target=lambda: out.append(v.answers_equivalent(expr, "18")))
    thread.start()
    thread.join(timeout=10)
    assert out == [False] and time.perf_counter() - start < 2.0
    assert not any(v.too_costly(e) for e in ("2^{10}", "\\frac{1}{3}", "5!", "x != 3", "120"))
