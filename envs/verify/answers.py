"""Answer extraction and scoring: the one place where a model's answer is read out of its text (docs/verify.md).

Pure, no JAX; every call is bounded (docs/design.md invariants 7 and 14). Malformed model output never raises: it
scores 0 with a `reason`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from envs.verify import symbolic
from envs.verify.text import (MAX_ANSWER_CHARS, MAX_SYMBOLIC_CHARS, NUMBER, THINK_TAGS, UNITS,  # noqa: F401
                                as_fraction, fractions_equal, normalize_answer, normalize_unicode, strip_reasoning,
                                strip_unit, too_costly)

DEFAULT_TIMEOUT_S = symbolic.DEFAULT_TIMEOUT_S  # bound on one symbolic comparison (seconds)
REL_TOL = symbolic.REL_TOL
METHODS = ("hash", "boxed", "last_number")  # extraction rules, in priority order
STATUSES = ("ok", "wrong", "timeout", "memory_limit", "disk_limit", "output_limit", "runtime_error",
            "infra_error")

_NUMBER_RE = re.compile(NUMBER)
_NUMBER_RUN_RE = re.compile(r"[0-9,.\-]*")  # chars a number can contain (read on the reversed text)
_DIGIT_RUN_RE = re.compile(r"[0-9]*")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_RE = re.compile(r"[{}]")
_TAG_RE = re.compile(r"<(/?)([A-Za-z][\w-]*)>")
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_RUN_LIMIT = 4 * MAX_ANSWER_CHARS  # a run of number characters longer than this is read whole (and refused)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of scoring one response: reward 1.0 or 0.0, a status from STATUSES and a short reason.

    extracted: the answer read (None if none); method: "hash", "boxed", "last_number", "tests" or "none"."""

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
# Extraction (each function linear in len(text))


def extract_hash_answer(text: str) -> str | None:
    """Rest of the line after the LAST ``####`` in `text` (GSM8K format), stripped; None if absent or empty."""
    i = text.rfind("####")
    if i < 0:
        return None
    end = text.find("\n", i)
    answer = text[i + 4: end if end >= 0 else len(text)].strip()
    return answer or None


def _last_box(text: str) -> tuple[str | None, str]:
    """(content of the last box, reason when None). The brace scan stops after MAX_ANSWER_CHARS."""
    pos = len(text)
    while True:
        i = max(text.rfind("\\boxed", 0, pos), text.rfind("\\fbox", 0, pos))
        if i < 0:
            return None, "no \\boxed{"
        m = _BOX_RE.match(text, i)
        if m:
            break
        pos = i
    depth, start = 1, m.end()
    limit = min(len(text), start + MAX_ANSWER_CHARS + 1)
    for b in _BRACE_RE.finditer(text, start, limit):
        depth += 1 if b.group() == "{" else -1
        if depth == 0:
            return text[start:b.start()].strip(), ""
    if limit < len(text):
        return None, f"\\boxed{{}} content longer than MAX_ANSWER_CHARS={MAX_ANSWER_CHARS}"
    return None, "unclosed \\boxed{"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}``, nested braces kept, or None.

    None also when the last box is never closed (a truncated generation) or holds over MAX_ANSWER_CHARS."""
    return _last_box(text)[0]


def _last_run(text: str, run_re: re.Pattern) -> tuple[int, int]:
    """(start, end) of the run of `run_re` characters that ends at the last ASCII digit; (-1, -1) if none."""
    end = max(text.rfind(d) for d in "0123456789")
    if end < 0:
        return -1, -1
    return end + 1 - run_re.match(text[end::-1]).end(), end + 1


def last_number(text: str) -> str | None:
    """The last number in `text` (optional sign, thousands commas, decimals), or None.

    Only the final run of number characters is read; a run over 4 * MAX_ANSWER_CHARS is returned whole."""
    start, end = _last_run(text, _NUMBER_RUN_RE)
    if start < 0:
        return None
    if end - start > _RUN_LIMIT:
        return text[start:end]
    matches = _NUMBER_RE.findall(text, start, end)
    return matches[-1] if matches else None


def last_integer(text: str) -> int | None:
    """The last match of ``-?\\d+`` in `text` as an int ("1,234" reads 234), or None; the quickstart's held-out rule.

    Read after `normalize_unicode`; a run over 4300 digits (Python's int conversion limit) reads None."""
    if not isinstance(text, str):
        return None
    text = normalize_unicode(text)
    start, end = _last_run(text, _DIGIT_RUN_RE)
    if start < 0 or end - start > 4300:
        return None
    return int(text[start - 1 if start > 0 and text[start - 1] == "-" else start: end])


def extract_answer(text: str, methods: tuple[str, ...] = METHODS,
                   think_tags: tuple[str, str] | None = THINK_TAGS) -> tuple[str | None, str, str]:
    """(answer, method, reason) read out of a response after `normalize_unicode` and `strip_reasoning`.

    `methods` (a subset of METHODS, tried in METHODS order) restricts the rules; the first whose marker is present
    decides, even when unreadable (answer None, with a reason). Raises ValueError on bad `methods`/`think_tags` only."""
    if not set(methods) <= set(METHODS):
        raise ValueError(f"extract_answer: methods must be a subset of {METHODS}, got {methods}")
    if not isinstance(text, str) or not text.strip():
        strip_reasoning("", think_tags)  # validates think_tags
        return None, "none", "empty response"
    text = strip_reasoning(normalize_unicode(text), think_tags)
    if not text.strip():
        return None, "none", "no reply after the reasoning trace"
    if "hash" in methods and "####" in text:
        answer = extract_hash_answer(text)
        return answer, "hash", "" if answer else "nothing after ####"
    if "boxed" in methods and _BOX_RE.search(text):
        answer, reason = _last_box(text)
        return answer, "boxed", reason
    answer = last_number(text) if "last_number" in methods else None
    if answer is None:
        return None, "none", f"no answer found (rules tried: {', '.join(methods)})"
    return answer, "last_number", ""


def gold_answer(solution: str) -> str:
    """The reference answer of a task: the ``####`` line of a GSM8K solution, else the whole string.

    Raises ValueError when `solution` is empty or has an empty ``####`` line."""
    if not isinstance(solution, str) or not solution.strip():
        raise ValueError(f"gold solution must be a non-empty str, got {solution!r}")
    solution = normalize_unicode(solution)
    if "####" in solution:
        answer = extract_hash_answer(solution)
        if answer is None:
            raise ValueError(f"gold solution has an empty #### line: {solution[-80:]!r}")
        return answer
    return solution.strip()


# ---------------------------------------------------------------------------------------------------
# Normalisation and equivalence


def compare_answers(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool | None, str]:
    """(equal, reason) for answer `pred` against reference `gold`, both already extracted.

    equal is None on a timeout or infra failure ("timeout: ..." / "infra: ..."); raises only on a bad `timeout_s`."""
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False, "answer is not a str"
    if len(pred) > MAX_ANSWER_CHARS and pred != gold:
        return False, f"answer of {len(pred)} chars is longer than MAX_ANSWER_CHARS={MAX_ANSWER_CHARS}"
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True, ""
    fp, fg = as_fraction(p), as_fraction(g)
    if fp is not None and fg is not None:
        return fractions_equal(p, fp, g, fg), ""
    if too_costly(p) or too_costly(g):
        return False, "too costly to compare symbolically"
    return symbolic.pool().compare(p, g, timeout_s)


def answers_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether `pred` equals `gold` by `compare_answers` ("0.5" == "\\frac{1}{2}"); a timeout counts as not equal."""
    return compare_answers(pred, gold, timeout_s)[0] is True


def score_math(response: str, gold: str, methods: tuple[str, ...] = METHODS, *,
               think_tags: tuple[str, str] | None = THINK_TAGS, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Score a free-form math response against the extracted reference answer `gold`.

    Reward 1.0, status "ok" when `extract_answer(response, methods, think_tags)` is equivalent; else 0.0 with
    status "wrong", "timeout" or "infra_error" and a reason. Never raises on a malformed `response`; raises
    ValueError on unknown `methods`, malformed `think_tags` or a non-positive `timeout_s`."""
    if not set(methods) <= set(METHODS):
        raise ValueError(f"score_math: methods must be a subset of {METHODS}, got {methods}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"score_math: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    strip_reasoning("", think_tags)  # validates think_tags
    try:
        answer, method, reason = extract_answer(response, methods, think_tags)
        if answer is None:
            return Verdict(0.0, "wrong", None, gold, method, reason)
        shown = answer if len(answer) <= MAX_ANSWER_CHARS else answer[:MAX_ANSWER_CHARS] + "..."
        equal, why = compare_answers(answer, normalize_unicode(gold), timeout_s)
        if equal:
            return Verdict(1.0, "ok", shown, gold, method, "")
        if equal is None:
            return Verdict(0.0, "timeout" if why.startswith("timeout") else "infra_error", shown, gold, method, why)
        return Verdict(0.0, "wrong", shown, gold, method, why or "answer differs from gold")
    except Exception as exc:  # noqa: BLE001 - malformed output scores 0 with a reason
        return Verdict(0.0, "wrong", None, gold, "none", f"verifier error: {exc!r}")


# ---------------------------------------------------------------------------------------------------
# Code (unit tests) and format


def score_unit_tests(result: Any) -> Verdict:
    """A Verdict from the sandbox result (duck-typed `envs.sandbox.SandboxResult`) of a program and its tests.

    Exit 0 is all it reads, so an early ``sys.exit(0)`` passes (HumanEval judges outside: `envs.tasks.humaneval_io`)."""
    status = getattr(result, "status", "infra_error")
    if status not in STATUSES or status == "wrong":
        return Verdict(0.0, "infra_error", method="tests", reason=f"unknown sandbox status {status!r}")
    stderr = getattr(result, "stderr", "") or ""
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if status == "ok" and getattr(result, "returncode", None) == 0:
        return Verdict(1.0, "ok", method="tests", reason="")
    if status in ("ok", "runtime_error") and tail.startswith("AssertionError"):
        return Verdict(0.0, "wrong", method="tests", reason=tail[:300])
    if status == "ok":
        status = "runtime_error"
    reason = tail or getattr(result, "reason", "") or status
    return Verdict(0.0, status, method="tests", reason=reason[:300])


def check_format(text: str, tags: tuple[str, ...] = ("think", "answer")) -> tuple[bool, str]:
    """(ok, reason): whether `text` is exactly ``<t1>...</t1> <t2>...</t2> ...`` for `tags`, tags paired by name.

    Never raises on odd input."""
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
    """Bodies of the fenced blocks of `text` whose language tag is in `languages` (case-insensitive), in order.

    An empty-string entry accepts untagged fences; an unclosed final fence is ignored. Never raises."""
    if not isinstance(text, str):
        return []
    wanted = {lang.lower() for lang in languages}
    blocks = []
    for m in _FENCE_RE.finditer(text):
        if m.group(1).lower() in wanted:
            blocks.append(m.group(2))
    return blocks


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` in `text`, stripped, or None. Never raises on odd text.

    Linear in len(text): the text after the last ``</tag>`` is dropped before the regex runs, so no scan starts at
    an opening tag that is never closed."""
    if not isinstance(text, str):
        return None
    close = f"</{tag}>"
    end = text.rfind(close)
    if end < 0:
        return None
    matches = re.findall(rf"<{re.escape(tag)}>(.*?){re.escape(close)}", text[:end + len(close)], flags=re.S)
    return matches[-1].strip() if matches else None
