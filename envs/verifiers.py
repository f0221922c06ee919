"""Answer extraction and scoring: the one place where a model's answer is read out of its text.

Pure functions, no I/O, no JAX. Every environment scores through this module (DESIGN.md invariant 7).

Extraction (`extract_answer`), in priority order:
  1. GSM8K final-answer line ``#### <answer>`` (Cobbe et al. 2021, "Training Verifiers to Solve Math
     Word Problems", arXiv:2110.14168): the LAST ``####`` anywhere in the text, rest of its line.
  2. ``\\boxed{...}`` / ``\\fbox{...}`` (MATH convention, Hendrycks et al. 2021, arXiv:2103.03874),
     brace-balanced, the last one wins; a box that is opened but never closed yields None.
  3. The last number in the text (``-1,234.5`` style), so "The answer is 122." reads 122.

Equivalence (`answers_equivalent`): after `normalize_answer`, two plain numbers compare exactly as
fractions; anything else goes through HuggingFace `math-verify` (symbolic, LaTeX), then string equality.

Malformed model output never raises: it scores 0 with a `reason`.
"""
from __future__ import annotations

import dataclasses
import fractions
import re
import threading
from typing import Any

MAX_SYMBOLIC_CHARS = 300  # longer answers are compared as strings only
METHODS = ("hash", "boxed", "last_number")  # extraction rules, in priority order
STATUSES = ("ok", "wrong", "timeout", "memory_limit", "output_limit", "runtime_error", "infra_error")

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INT_RE = re.compile(r"-?\d+")
_TAG_RE = re.compile(r"<(/?)([A-Za-z][\w-]*)>")
_UNIT_RE = re.compile(rf"^({_NUMBER})\s*(?:[A-Za-z][A-Za-z./\s]*|%|\\%)$")
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of scoring one response.

    reward: 1.0 or 0.0. status: one of STATUSES. extracted: the answer read from the response (None if
    none could be read). gold: the reference answer. method: how it was read ("hash", "boxed",
    "last_number", "tests", "none"). reason: a short human-readable explanation.
    """

    reward: float
    status: str
    extracted: str | None = None
    gold: str | None = None
    method: str = "none"
    reason: str = ""

    def info(self) -> dict[str, Any]:
        """The verdict as an env `info` dict (without the reward, which step() returns separately)."""
        return {"status": self.status, "extracted": self.extracted, "gold": self.gold,
                "method": self.method, "reason": self.reason}


# ---------------------------------------------------------------------------------------------------
# Extraction


def extract_hash_answer(text: str) -> str | None:
    """Rest of the line after the LAST ``####`` anywhere in `text` (GSM8K format), stripped.

    Returns None when there is no ``####`` or the line after it is empty.
    """
    matches = _HASH_RE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (brace-balanced), or None.

    Nested braces are kept: ``\\boxed{\\frac{1}{3}}`` -> ``\\frac{1}{3}``. If the last box is never closed
    (``\\boxed{12``, e.g. a truncated generation) the result is None.
    """
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (optional sign, thousands commas, decimals), or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def last_integer(text: str) -> int | None:
    """The last run of digits (with an optional leading ``-``) in `text` as an int, or None.

    This is the quickstart's held-out rule ("the last integer in the reply", regex ``-?\\d+``), the same
    rule as the TRL peer in PLATFORM-NOTES.md; "1,234" reads 234 and "12.5" reads 5 under it.
    """
    matches = _INT_RE.findall(text) if isinstance(text, str) else []
    return int(matches[-1]) if matches else None


def extract_answer(text: str, methods: tuple[str, ...] = METHODS) -> tuple[str | None, str, str]:
    """Read the final answer out of a model response.

    `methods` restricts the rules tried (a subset of METHODS, always applied in METHODS order):
    "hash" (``####`` line), "boxed" (``\\boxed{}``/``\\fbox{}``), "last_number". The first rule whose
    marker is present decides, even when its content is unreadable (an unclosed box reads None).
    Returns (answer, method, reason): answer is None (with a reason) when nothing can be read.
    Never raises; non-str input reads as nothing. Raises ValueError only on an unknown method name.
    """
    if not set(methods) <= set(METHODS):
        raise ValueError(f"extract_answer: methods must be a subset of {METHODS}, got {methods}")
    if not isinstance(text, str) or not text.strip():
        return None, "none", "empty response"
    if "hash" in methods and "####" in text:
        answer = extract_hash_answer(text)
        return answer, "hash", "" if answer else "nothing after ####"
    if "boxed" in methods and _BOX_RE.search(text):
        answer = extract_boxed(text)
        return answer, "boxed", "" if answer is not None else "unclosed \\boxed{"
    answer = last_number(text) if "last_number" in methods else None
    if answer is None:
        return None, "none", f"no answer found (rules tried: {', '.join(methods)})"
    return answer, "last_number", ""


def gold_answer(solution: str) -> str:
    """The reference answer of a task: the ``####`` line of a GSM8K solution, else the whole string.

    Raises ValueError when `solution` is empty or has an empty ``####`` line.
    """
    if not isinstance(solution, str) or not solution.strip():
        raise ValueError(f"gold solution must be a non-empty str, got {solution!r}")
    if "####" in solution:
        answer = extract_hash_answer(solution)
        if answer is None:
            raise ValueError(f"gold solution has an empty #### line: {solution[-80:]!r}")
        return answer
    return solution.strip()


# ---------------------------------------------------------------------------------------------------
# Normalisation and equivalence


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: math delimiters and ``$`` dropped, thousands commas removed,
    trailing units (``42 apples``, ``5 km/h``, ``5\\text{ cm}``, ``50%``) and ``.0`` removed, trailing
    period and markdown ``**``/backticks around the answer dropped.

    "$1,234.00" -> "1234"; "42 apples" -> "42"; "\\frac{1}{2}" is left as is.
    """
    s = answer.strip().strip("*`").strip()  # markdown emphasis / code: "**18**"
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right):
            s = s[len(left):-len(right)]
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[!,;: ]", "", s)
    s = re.sub(r"\s*\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$", "", s).strip()
    s = s.rstrip(".").strip()
    unit = _UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    if re.fullmatch(_NUMBER, s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".") or "0"
        if s in ("-0", "-"):
            s = "0"
    return s


def as_fraction(s: str) -> fractions.Fraction | None:
    """Exact value of a plain number, ``a/b`` or ``\\frac{a}{b}`` (normalised input), else None."""
    if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+|-?\d+/\d+", s):
        try:
            return fractions.Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRAC_RE.match(s)
    if m and int(m.group(3)) != 0:
        return fractions.Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    return None


def too_costly(expr: str) -> bool:
    """Whether symbolic evaluation of `expr` could take unbounded time or memory: longer than
    MAX_SYMBOLIC_CHARS, two or more powers (towers such as ``9^{9^{9^9}}``), an exponent of 4+ digits,
    or a factorial of anything but a literal of at most 3 digits. math-verify's own timeout is a SIGALRM, available only on the
    main thread, so this screen is what bounds the cost in worker threads."""
    if len(expr) > MAX_SYMBOLIC_CHARS or expr.count("^") + expr.count("**") >= 2:
        return True
    if re.search(r"\^\s*\{?\s*[-+]?\d{4,}", expr):
        return True
    return any(not re.search(r"(?<!\d)\d{1,3}\s*$", expr[:m.start()]) for m in re.finditer(r"!(?!=)", expr))


def _math_verify_equal(pred: str, gold: str) -> bool:
    """Symbolic equivalence through `math-verify` (signal timeouts only on the main thread)."""
    import math_verify

    if too_costly(pred) or too_costly(gold):
        return False
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 3 if on_main else None
    gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = math_verify.parse(f"${pred}$", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_equivalent(pred: str, gold: str) -> bool:
    """Whether answer `pred` equals reference `gold` (both already extracted, not whole responses).

    Plain numbers and simple fractions compare exactly ("0.5" == "\\frac{1}{2}", "$1,234.00" == "1234");
    other expressions go through math-verify ("2^{10}" == "1024"), except those `too_costly` to evaluate;
    equal normalised strings are equivalent ("E" == "E"). Never raises: a parse failure counts as not
    equivalent.
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True
    fp, fg = as_fraction(p), as_fraction(g)
    if fp is not None and fg is not None:
        return fp == fg
    try:
        return _math_verify_equal(p, g)
    except Exception:  # noqa: BLE001 - a verifier failure on odd text must score 0, not crash
        return False


def score_math(response: str, gold: str, methods: tuple[str, ...] = METHODS) -> Verdict:
    """Score a free-form math response against reference answer `gold` (already extracted), reading
    the answer with `extract_answer(response, methods)`.

    Returns a Verdict with reward 1.0 / status "ok" when the extracted answer is equivalent, else
    reward 0.0 / status "wrong" with a reason. Never raises on malformed `response`; raises
    ValueError on unknown `methods`.
    """
    if not set(methods) <= set(METHODS):
        raise ValueError(f"score_math: methods must be a subset of {METHODS}, got {methods}")
    try:
        answer, method, reason = extract_answer(response, methods)
        if answer is None:
            return Verdict(0.0, "wrong", None, gold, method, reason)
        if answers_equivalent(answer, gold):
            return Verdict(1.0, "ok", answer, gold, method, "")
        return Verdict(0.0, "wrong", answer, gold, method, "answer differs from gold")
    except Exception as exc:  # noqa: BLE001 - malformed output scores 0 with a reason
        return Verdict(0.0, "wrong", None, gold, "none", f"verifier error: {exc!r}")


# ---------------------------------------------------------------------------------------------------
# Code (unit tests) and format


def score_unit_tests(result: Any, success_marker: str | None = None) -> Verdict:
    """Turn a sandbox result (`envs.sandbox.SandboxResult`, duck-typed: status, returncode, stdout,
    stderr, reason) of running a program plus its unit tests into a Verdict.

    Passing (status "ok", returncode 0, and, when `success_marker` is given, the last stdout line equal
    to it) -> reward 1, "ok". Exit 0 without the marker (the program left before its tests finished,
    e.g. ``sys.exit(0)`` in the candidate) -> "wrong". A failed assertion -> "wrong". Other sandbox
    statuses pass through (runtime_error, timeout, memory_limit, output_limit, infra_error), reward 0.
    """
    status = getattr(result, "status", "infra_error")
    if status not in STATUSES or status == "wrong":
        return Verdict(0.0, "infra_error", method="tests", reason=f"unknown sandbox status {status!r}")
    stderr = getattr(result, "stderr", "") or ""
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if status == "ok" and getattr(result, "returncode", None) == 0:
        stdout_lines = (getattr(result, "stdout", "") or "").strip().splitlines()
        if success_marker is None or (stdout_lines and stdout_lines[-1].strip() == success_marker):
            return Verdict(1.0, "ok", method="tests", reason="")
        return Verdict(0.0, "wrong", method="tests", reason="exited 0 before the tests completed")
    if status in ("ok", "runtime_error") and tail.startswith("AssertionError"):
        return Verdict(0.0, "wrong", method="tests", reason=tail[:300])
    if status == "ok":
        status = "runtime_error"
    reason = tail or getattr(result, "reason", "") or status
    return Verdict(0.0, status, method="tests", reason=reason[:300])


def check_format(text: str, tags: tuple[str, ...] = ("think", "answer")) -> tuple[bool, str]:
    """Whether `text` is exactly the sequence ``<t1>...</t1> <t2>...</t2> ...`` for `tags`.

    Every ``<x>``/``</x>`` in the text must pair with its own name (a stack; ``<think>...</tool>`` fails),
    and the top-level elements must be `tags` in order with only whitespace between them.
    Returns (ok, reason). Never raises on odd input.
    """
    if not isinstance(text, str):
        return False, "response is not a str"
    stack: list[str] = []
    top_level: list[str] = []
    last_end = 0
    for m in _TAG_RE.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if not stack and text[last_end:m.start()].strip():
            return False, f"text outside tags before <{'/' if closing else ''}{name}>"
        if not closing:
            if not stack:
                top_level.append(name)
            stack.append(name)
        elif not stack or stack[-1] != name:
            expected = f"</{stack[-1]}>" if stack else "no closing tag"
            return False, f"</{name}> does not pair (expected {expected})"
        else:
            stack.pop()
        last_end = m.end()
    if stack:
        return False, f"<{stack[-1]}> is never closed"
    if text[last_end:].strip():
        return False, "text after the last tag"
    if tuple(top_level) != tuple(tags):
        return False, f"tags {top_level} != expected {list(tags)}"
    return True, ""


def extract_code_blocks(text: str, languages: tuple[str, ...] = ("python", "py")) -> list[str]:
    """Bodies of the fenced ```<lang> blocks in `text` whose language tag is in `languages` (case-
    insensitive), in order; an empty-string entry in `languages` also accepts untagged fences.

    An unclosed final fence is ignored (truncated generation). Never raises.
    """
    if not isinstance(text, str):
        return []
    wanted = {lang.lower() for lang in languages}
    blocks = []
    for m in _FENCE_RE.finditer(text):
        if m.group(1).lower() in wanted:
            blocks.append(m.group(2))
    return blocks


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` in `text`, stripped, or None."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return matches[-1].strip() if matches else None
