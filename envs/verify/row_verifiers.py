"""The verifier functions `envs.verify.named` selects by name: each scores one reply against one task-file row.

Each takes ``(reply, row, *, bound_s, **args)`` and returns an `answers.Verdict`; the row was checked beforehand
(`named.check_row`). Rules per verifier: their docstrings and docs/verifiers.md. Pure, no JAX; a malformed reply
scores 0 with a reason and never raises, and each call is bounded in time (docs/design.md invariant 14).
"""
from __future__ import annotations

import fractions
import json
import math
import re
import string
import unicodedata
from collections.abc import Mapping
from typing import Any

import jsonschema
import regex

from envs.verify import answers

EXTRACT_MODES = ("auto", "answer_tag", "hash", "boxed", "last_line", "whole")
REGEX_TIMEOUT_S = 1.0  # most seconds one pattern runs on one reply: longer is catastrophic backtracking
JSON_SCAN_CHARS = 64 * 1024  # only this tail of a reply is searched for JSON (chars)
MAX_REASON_CHARS = 300

_EXPONENT = r"(?:[eE][-+]?\d{1,4})?"
_NUMBER_RE = re.compile(rf"[-+]?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d*)?{_EXPONENT}|[-+]?\.\d+{_EXPONENT}")
_PHRASE_RE = re.compile(r"(?i:\banswer\b)(?:\s+is\s*:?|\s*:)\s*(?i:(?:option|choice)\s+)?"
                        r"(\(|\[|\*\*)?([A-Za-z])(?:\)|\]|\*\*)?(?![A-Za-z0-9])")
_BARE_LETTER_RE = re.compile(r"\s*(?:\(|\[|\*\*)?([A-Za-z])(?:\)|\]|\*\*)?[.:]?\s*")
_OPTION_RE = re.compile(r"\s*\(?([A-Za-z])[).:]\s+\S")  # "B) Paris": a letter, then the option's text
_NAMED_LOOSE_RE = re.compile(r"(?<![A-Za-z0-9])(?:\(([A-Za-z])\)|([A-Z]))(?![A-Za-z0-9])")
_NAMED_STRICT_RE = re.compile(r"(?<![A-Za-z0-9])(?:\(([A-Za-z])\)|([A-Z])[).:](?=\s|$))")
_SENTENCE_END_RE = re.compile(r"[.;!?](?=\s|$)")
_JSON_CHARS_RE = re.compile(r'[{}\[\]"\\]')
_CLOSER = {"}": "{", "]": "["}


# --------------------------------------------------------------------------------------------- helpers
def finite(v) -> bool:
    """Whether `v` is a finite int or float (bools excluded)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fail(reason: str, extracted=None, gold=None, method: str = "none", status: str = "wrong") -> answers.Verdict:
    shown = extracted if extracted is None or len(extracted) <= answers.MAX_ANSWER_CHARS else (
        extracted[:answers.MAX_ANSWER_CHARS] + "...")
    return answers.Verdict(0.0, status, shown, gold, method, reason[:MAX_REASON_CHARS])


def _clean(reply, normalize: bool = True) -> tuple[str | None, str]:
    """(reply after `normalize_unicode` and `strip_reasoning`, "") or (None, why it cannot be read)."""
    if not isinstance(reply, str):
        return None, f"reply is a {type(reply).__name__}, not a str"
    text = answers.strip_reasoning(answers.normalize_unicode(reply) if normalize else reply)
    if not text.strip():
        return None, "empty reply" if not reply.strip() else "no reply after the reasoning trace"
    return text, ""


def _extract(text: str, mode: str) -> tuple[str | None, str]:
    """(answer or None, rule used); "auto": the first rule whose marker is present decides."""
    if mode == "auto":
        mode = ("answer_tag" if "<answer>" in text or "</answer>" in text else "hash" if "####" in text
                else "boxed" if "\\boxed" in text or "\\fbox" in text else "last_line")
    if mode == "answer_tag":
        found = answers.extract_tag(text, "answer")
    elif mode == "hash":
        found = answers.extract_hash_answer(text)
    elif mode == "boxed":
        found = answers.extract_boxed(text)
    elif mode == "last_line":
        text = text.rstrip()
        found = text[text.rfind("\n") + 1:].strip()
    else:
        found = text.strip()
    return found or None, mode


# --------------------------------------------------------------------------------------------- exact
def accepted_answers(answer) -> list[str]:
    """The accepted answers of a row: its str answer, or the items of its list of answers."""
    return [answer] if isinstance(answer, str) else list(answer)


def _canon(s: str, case_sensitive: bool, strip_punctuation: bool) -> str:
    s = answers.normalize_unicode(s)
    if strip_punctuation:
        s = "".join(c for c in s if not unicodedata.category(c).startswith("P"))
    s = " ".join(s.split())
    return s if case_sensitive else s.casefold()


_WRAPPERS = ("**", "__", "*", "_", "`", "\"")  # markdown emphasis, code and quotes a model puts around an answer


def _unwrap(answer: str) -> str:
    """`answer` without one pair of wrappers around it ("**Paris**", "`Paris`", '"Paris"'), stripped."""
    answer = answer.strip()
    for w in _WRAPPERS:
        if len(answer) > 2 * len(w) and answer.startswith(w) and answer.endswith(w):
            return answer[len(w):-len(w)].strip()
    return answer


def verify_exact(reply, row, *, case_sensitive=False, strip_punctuation=False, extract="auto",
                 bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """Reward 1 when the extracted answer equals row["answer"] (a str, or a list of acceptable strs).

    Extraction (`extract`): "auto" takes the first rule whose marker the reply has: the last ``<answer>...</answer>``,
    else the text after the last ``####``, else the last ``\\boxed{}``, else the last non-empty line; or one rule
    by name ("answer_tag", "hash", "boxed", "last_line", "whole"). Both sides: NFKC (`normalize_unicode`),
    whitespace runs collapsed to one space and stripped, casefolded unless `case_sensitive`, Unicode punctuation
    (category P*) dropped when `strip_punctuation`; one pair of markdown or quote wrappers around the extracted
    answer is dropped (``**Paris**``, ```Paris```, ``"Paris"``). An answer over 2 * the longest gold + MAX_ANSWER_CHARS chars
    is refused unread. A reply that holds the answer elsewhere (the prompt, a list of candidates) does not pass."""
    golds = accepted_answers(row["answer"])
    text, why = _clean(reply)
    if text is None:
        return _fail(why, gold=golds[0])
    found, method = _extract(text, extract)
    if found is None:
        return _fail(f"no answer found (rule {method})", gold=golds[0], method=method)
    if len(found) > 2 * max(map(len, golds)) + answers.MAX_ANSWER_CHARS:
        return _fail(f"answer of {len(found)} chars is far longer than the reference", found, golds[0], method)
    got = _canon(_unwrap(found), case_sensitive, strip_punctuation)
    if any(got == _canon(g, case_sensitive, strip_punctuation) for g in golds):
        return answers.Verdict(1.0, "ok", found, golds[0], method)
    return _fail("answer differs from the reference", found, golds[0], method)


# --------------------------------------------------------------------------------------------- numeric
def parse_number(text: str, units: bool = True) -> fractions.Fraction | None:
    """The exact value of a number written as text, or None.

    Accepts "1,234.5", "-3", "1e-3", "45%" (45), "\\frac{1}{2}", "3/4", "$12" and, with `units`, one trailing unit
    of `text.UNITS` ("42 dollars"); numerals are made ASCII first. None for anything else or over MAX_ANSWER_CHARS."""
    s = answers.normalize_unicode(text).strip().strip("*`").strip()
    s = s.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    if len(s) > answers.MAX_ANSWER_CHARS:
        return None
    if units:
        s = answers.strip_unit(s).strip()
    s = s[:-2] if s.endswith("\\%") else s.removesuffix("%")
    s = s.strip()
    if _NUMBER_RE.fullmatch(s):
        return fractions.Fraction(s.replace(",", ""))
    return answers.as_fraction(s)


_HEDGE_RE = re.compile(r"\b(or|either|maybe|perhaps|between)\b", re.IGNORECASE)
_TOKEN_EDGES = "()[]{}.,;:!?\"'*`"


def _last_number_token(text: str) -> tuple[str | None, str]:
    """(the last whitespace-separated token holding a digit on the reply's last line, "") or (None, why).

    Refuses a last line that hedges between numbers ("43 or 42", "either 4 or 5")."""
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if len(last) > 4 * answers.MAX_ANSWER_CHARS:
        last = last[-4 * answers.MAX_ANSWER_CHARS:]
    tokens = [t.strip(_TOKEN_EDGES) for t in last.split()]
    numbers = [t for t in tokens if any(c.isdigit() for c in t)]
    if not numbers:
        return None, "no number on the reply's last line"
    if len(set(numbers)) > 1 and _HEDGE_RE.search(last):
        return None, f"the last line offers several numbers ({', '.join(numbers[:4])}); one answer is scored"
    return numbers[-1].rsplit("=", 1)[-1], ""  # "x=5" reads 5


def gold_number(answer) -> fractions.Fraction | None:
    """A row's numeric answer as an exact Fraction (a number, or a str `parse_number` reads), else None."""
    if finite(answer):
        return fractions.Fraction(answer)
    return parse_number(answer) if isinstance(answer, str) else None


def verify_numeric(reply, row, *, tolerance=0.0, rel_tolerance=1e-9, units=True,
                   bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """Reward 1 when the reply's number is within `tolerance` (absolute) or `rel_tolerance` of row["answer"].

    The number: the last ``<answer>`` tag's content when the reply has the tag (the whole content must be a
    number), else `answers.extract_answer` (``####``, ``\\boxed{}``, the last number). It is read by
    `parse_number`: thousands commas, a sign, decimals, an exponent, a percent sign ("45%" is 45), fractions,
    Unicode digits (Arabic-Indic, full-width) and, when `units`, one trailing unit. Compared exactly (fractions):
    ``|got - gold| <= tolerance`` or ``<= rel_tolerance * max(|got|, |gold|)``."""
    gold = gold_number(row["answer"])
    shown_gold = str(row["answer"])
    text, why = _clean(reply)
    if text is None:
        return _fail(why, gold=shown_gold)
    if "<answer>" in text or "</answer>" in text:
        found, method, why = answers.extract_tag(text, "answer"), "answer_tag", "empty or unclosed <answer> tag"
    else:
        found, method, why = answers.extract_answer(text, think_tags=None)
        if found and method == "last_number":  # read the whole last number, not the digits that end "3/4" or "4.2e2"
            found, why = _last_number_token(text)
    if not found:
        return _fail(why, gold=shown_gold, method=method)
    got = parse_number(found, units)
    if got is None:
        too_long = len(found) > answers.MAX_ANSWER_CHARS
        return _fail(f"answer of {len(found)} chars is longer than MAX_ANSWER_CHARS" if too_long
                     else "answer is not a number", found, shown_gold, method)
    diff = abs(got - gold)
    if diff <= fractions.Fraction(tolerance) or diff <= fractions.Fraction(rel_tolerance) * max(abs(got), abs(gold)):
        return answers.Verdict(1.0, "ok", found, shown_gold, method)
    return _fail("number differs from the reference", found, shown_gold, method)


# --------------------------------------------------------------------------------------------- math
def verify_math(reply, row, *, methods=answers.METHODS, bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """`answers.score_math` of the reply against row["answer"] (a GSM8K solution "... #### N" reads N).

    `methods` restricts extraction to a subset of `answers.METHODS`; `bound_s` bounds a symbolic comparison."""
    gold = answers.gold_answer(str(row["answer"]))
    return answers.score_math(reply, gold, tuple(methods), timeout_s=bound_s)


# --------------------------------------------------------------------------------------------- regex
def _regex_flags(flags: str) -> int:
    return ((regex.IGNORECASE if "i" in flags else 0) | (regex.MULTILINE if "m" in flags else 0)
            | (regex.DOTALL if "s" in flags else 0))


def verify_regex(reply, row, *, pattern=None, mode="fullmatch", flags="",
                 bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """Reward 1 when `pattern` (else row["pattern"]) matches the reply, within min(bound_s, REGEX_TIMEOUT_S) seconds.

    "fullmatch": the whole answer extracted as `verify_exact` does with extract "auto" (stripped); "search":
    anywhere in the reply. The reply is read after `normalize_unicode` and `strip_reasoning`. `flags`: any of
    "i" (ignore case), "m" (multi-line), "s" (dot matches newline). Runs in the `regex` package with its timeout:
    a pattern still running then scores 0 with status "timeout"."""
    pattern = row["pattern"] if pattern is None else pattern
    compiled = regex.compile(pattern, _regex_flags(flags))
    text, why = _clean(reply)
    if text is None:
        return _fail(why, gold=pattern)
    target, method = (text, "search") if mode == "search" else _extract(text, "auto")
    if target is None:
        return _fail(f"no answer found (rule {method})", gold=pattern, method=method)
    limit = min(bound_s, REGEX_TIMEOUT_S)
    try:
        match = (compiled.search if mode == "search" else compiled.fullmatch)(target, timeout=limit)
    except TimeoutError:
        return _fail(f"pattern ran past {limit:g} s", None, pattern, method, "timeout")
    shown = match.group() if match else (None if mode == "search" else target)
    if match:
        return answers.Verdict(1.0, "ok", shown[:answers.MAX_ANSWER_CHARS], pattern, method)
    return _fail(f"pattern does not {'match anywhere' if mode == 'search' else 'match the whole answer'}",
                 shown, pattern, method)


# --------------------------------------------------------------------------------------------- choice
def choice_letters(row, choices) -> str:
    """The choice letters of a row: `choices` as given, else A.. for its listed choices, else "ABCD"."""
    if isinstance(choices, str):
        return choices.upper()
    if isinstance(choices, int):
        return string.ascii_uppercase[:choices]
    listed = row.get("choices")
    if isinstance(listed, (list, tuple)) and 2 <= len(listed) <= 26:
        return string.ascii_uppercase[:len(listed)]
    return "ABCD"


def choice_gold(row, letters: str) -> tuple[str | None, str]:
    """(gold letter, "") or (None, the problem) of a choice row.

    row["answer"] is a letter, a 0-based index (an int, or digits as text when no choice's text is those digits) or
    a choice's text."""
    answer, listed = row.get("answer"), row.get("choices")
    if isinstance(answer, int) and not isinstance(answer, bool):
        return (letters[answer], "") if 0 <= answer < len(letters) else (None, f"answer index {answer} out of range")
    if not isinstance(answer, str):
        return None, "'answer' must be a letter, an index or a choice's text"
    letter = answer.strip().strip("()").strip().upper()
    if len(letter) == 1 and letter in letters:
        return letter, ""
    if isinstance(listed, (list, tuple)) and answer in listed and listed.index(answer) < len(letters):
        return letters[listed.index(answer)], ""
    if answer.strip().isdigit() and answer.strip().isascii():  # an index written as text (a CSV cell)
        return choice_gold({**row, "answer": int(answer.strip())}, letters)
    return None, f"answer {answer[:40]!r} is not among the choices {letters}"


def _last_phrase(text: str) -> tuple[str, str] | None:
    """(letter, rest of its sentence) of the last "answer is X" / "Answer: (X)"; "answer is a ..." is an article."""
    found = None
    for m in _PHRASE_RE.finditer(text):
        if m.group(2).islower() and not m.group(1) and re.match(r"\s+[A-Za-z]", text[m.end():m.end() + 2]):
            continue
        found = m
    if found is None:
        return None
    eol = text.find("\n", found.start(2))
    return found.group(2), _SENTENCE_END_RE.split(text[found.start(2):eol if eol >= 0 else len(text)], maxsplit=1)[0]


def _read_choice(text: str) -> tuple[str | None, str, str]:
    """(letter, the span that gave it, method): the answer tag, else the last phrase, else a bare last line."""
    if "<answer>" in text or "</answer>" in text:
        content = answers.extract_tag(text, "answer") or ""
        if len(content) > answers.MAX_ANSWER_CHARS:
            return None, "", "answer_tag"
        m = _BARE_LETTER_RE.fullmatch(content) or _OPTION_RE.match(content)
        if m:
            return m.group(1), content, "answer_tag"
        phrase = _last_phrase(content)
        return (phrase[0], phrase[1], "answer_tag") if phrase else (None, content, "answer_tag")
    phrase = _last_phrase(text)
    if phrase:
        return phrase[0], phrase[1], "phrase"
    stripped = text.rstrip()
    line = stripped[stripped.rfind("\n") + 1:]
    m = _BARE_LETTER_RE.fullmatch(line) if len(line) <= 16 else None
    return (m.group(1), line, "last_line") if m else (None, line[:answers.MAX_ANSWER_CHARS], "none")


def _named(segment: str, letters: str) -> set[str]:
    """The choices a span names: wrapped letters "(b)" and capital letters; only "B)"-style ones after option text."""
    pattern = _NAMED_STRICT_RE if _OPTION_RE.match(segment) else _NAMED_LOOSE_RE
    return {(a or b).upper() for a, b in pattern.findall(segment)} & set(letters)


def verify_choice(reply, row, *, choices=None, bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """Reward 1 when the reply's one chosen letter is row["answer"] (a letter, a 0-based index or a choice's text).

    Letters: `choices` (a str of letters, or a count), else as many as row["choices"] lists, else "ABCD". Read
    after `normalize_unicode` (full-width letters), case-insensitive, from: the last ``<answer>`` tag (content
    "B", "(B)", "B." or "B) text", or a phrase inside it), else the last "answer is X" / "Answer: (X)" / "answer
    is option X" phrase (a lowercase unwrapped letter before a word is an article, not read), else a last line
    that is only a letter ("B", "(B)", "**B**"). Scores 0 when the span read names two or more different choices
    ("A or B", "A, B, C, D"), or the letter is not among the choices."""
    letters = choice_letters(row, choices)
    gold, _ = choice_gold(row, letters)
    text, why = _clean(reply)
    if text is None:
        return _fail(why, gold=gold)
    letter, segment, method = _read_choice(text)
    named = _named(segment, letters)
    if len(named | ({letter.upper()} if letter else set())) > 1:
        return _fail(f"names several choices ({', '.join(sorted(named))})", segment, gold, method)
    if letter is None:
        return _fail("no choice letter found", None, gold, method)
    letter = letter.upper()
    if letter not in letters:
        return _fail(f"{letter} is not among the choices {letters}", letter, gold, method)
    if letter == gold:
        return answers.Verdict(1.0, "ok", letter, gold, method)
    return _fail("wrong choice", letter, gold, method)


# --------------------------------------------------------------------------------------------- json
def _balanced_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each top-level balanced {...} / [...] in `text` (strings inside respected), in order."""
    stack: list[str] = []
    spans, start, in_str, skip = [], 0, False, -1
    for m in _JSON_CHARS_RE.finditer(text):
        c, i = m.group(), m.start()
        if i < skip:
            continue
        if in_str:
            if c == "\\":
                skip = i + 2
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = bool(stack)
        elif c in "{[":
            start = i if not stack else start
            stack.append(c)
        elif c in "}]":
            if stack and stack[-1] == _CLOSER[c]:
                stack.pop()
                if not stack:
                    spans.append((start, i + 1))
            else:
                stack.clear()
    return spans


def extract_json(text: str) -> tuple[Any, str]:
    """(value, "") of the last JSON object/array in `text`, or (None, why); reads only the last JSON_SCAN_CHARS.

    The last ```json fenced block decides when there is one; else the last top-level balanced ``{...}``/``[...]``
    that parses (the last 8 tried), else the latest-ending value that parses from one of the last 16 brackets."""
    tail = text[-JSON_SCAN_CHARS:]
    note = f" in the last {JSON_SCAN_CHARS} chars of a {len(text)}-char reply" if len(text) > len(tail) else ""
    blocks = answers.extract_code_blocks(tail, ("json",))
    if blocks:
        try:
            return json.loads(blocks[-1]), ""
        except (ValueError, RecursionError) as exc:
            return None, f"```json block is not valid JSON: {str(exc)[:80]}"
    for start, end in reversed(_balanced_spans(tail)[-8:]):
        try:
            return json.loads(tail[start:end]), ""
        except (ValueError, RecursionError):
            continue
    decoder, best = json.JSONDecoder(), None
    opens = [m.start() for m in re.finditer(r"[{\[]", tail)][-16:]
    for pos in opens:
        try:
            value, end = decoder.raw_decode(tail, pos)
        except (ValueError, RecursionError):
            continue
        if best is None or end > best[1]:
            best = (value, end)
    return (best[0], "") if best else (None, f"no JSON object or array{note}")


def _same(got, gold, tol: float) -> bool:
    """JSON equality with numbers within `tol` (absolute); bools only equal bools."""
    if isinstance(got, bool) or isinstance(gold, bool):
        return type(got) is type(gold) and got == gold
    if isinstance(got, (int, float)) and isinstance(gold, (int, float)):
        try:
            return got == gold or abs(got - gold) <= tol
        except OverflowError:
            return False
    if isinstance(got, (list, tuple)) and isinstance(gold, (list, tuple)):
        return len(got) == len(gold) and all(_same(a, b, tol) for a, b in zip(got, gold))
    if isinstance(got, dict) and isinstance(gold, Mapping):
        return got.keys() == gold.keys() and all(_same(got[k], gold[k], tol) for k in gold)
    return type(got) is type(gold) and got == gold


def verify_json(reply, row, *, schema=None, fields=None, numeric_tolerance=0.0,
                bound_s=answers.DEFAULT_TIMEOUT_S) -> answers.Verdict:
    """Reward 1 when the reply's last JSON value fits `schema` and its `fields` equal row["answer"]'s.

    Extraction: `extract_json` on the reply after `strip_reasoning` (no Unicode normalisation; only the last
    JSON_SCAN_CHARS are read). `schema`: a JSON schema (the draft its "$schema" names, else the newest one), checked
    with `jsonschema`. Comparison, when the row has an "answer" dict: the value must be an object whose `fields`
    (default: every key of the answer) equal the answer's, recursively, numbers within `numeric_tolerance`
    (absolute), bools only equal bools, objects need the same keys."""
    gold = row.get("answer")
    text, why = _clean(reply, normalize=False)
    if text is None:
        return _fail(why)
    value, why = extract_json(text)
    if why:
        return _fail(why, method="json")
    shown = json.dumps(value)[:answers.MAX_ANSWER_CHARS]
    if schema is not None:
        error = next(jsonschema.validators.validator_for(schema)(schema).iter_errors(value), None)
        if error is not None:
            return _fail(f"schema: {error.message[:120]}", shown, None, "json")
    if isinstance(gold, Mapping):
        if not isinstance(value, dict):
            return _fail(f"a JSON {type(value).__name__}, not an object", shown, None, "json")
        for key in (gold.keys() if fields is None else fields):
            if key not in value:
                return _fail(f"no key {key!r}", shown, None, "json")
            if not _same(value[key], gold[key], numeric_tolerance):
                return _fail(f"{key!r} differs from the reference", shown, None, "json")
    return answers.Verdict(1.0, "ok", shown, None, "json")
