"""Text clean-up before answer extraction (helper of `envs.verify.answers`; pure, each function linear in its input).

`normalize_unicode` makes numerals ASCII, `strip_reasoning` cuts off a reasoning trace and `strip_unit` drops a
trailing unit from the one list `UNITS` (never a single letter: ``3x``, ``7i``, ``2e`` keep theirs).
"""
from __future__ import annotations

import fractions
import re
import unicodedata

from envs.verify.symbolic import REL_TOL  # relative tolerance for decimal approximations

MAX_ANSWER_CHARS = 300  # extracted answers longer than this are refused before comparison (chars)
MAX_SYMBOLIC_CHARS = MAX_ANSWER_CHARS  # too_costly refuses longer expressions
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"  # a plain number: -1,234.5
_NUMBER_RE = re.compile(NUMBER)
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")

# Minus signs NFKC leaves alone (U+2212 MINUS SIGN, figure dash, heavy minus, modifier minus); NFKC
# itself maps the small and full-width hyphen-minus (U+FE63, U+FF0D) to "-".
_MINUSES = "\u2212\u2012\u2796\u02d7"
_EN_DASH_RE = re.compile("(?<![\\w.])\u2013(?=\\d)")  # an en dash only as a sign ("–7"), not in a range ("3–5")
_GROUP_SPACES = "\u00a0\u2007\u2009\u200a\u202f"  # no-break, figure, thin, hair, narrow no-break
_GROUP_SPACE_RE = re.compile(f"(?<=\\d)[{_GROUP_SPACES}](?=\\d{{3}}(?!\\d))")  # 1 234 567
_INVISIBLE = ("\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"  # soft hyphen, zero-width, bidi
              "\u2060\u2061\u2062\u2063\u2064\ufeff")
_SUPER = dict(zip("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b\u207c\u207d\u207e",
                  "0123456789+-=()"))
_SUB = dict(zip("\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089\u208a\u208b\u208c\u208d\u208e",
                "0123456789+-=()"))
_VULGAR = "\u00bc\u00bd\u00be" + "".join(chr(c) for c in range(0x2150, 0x215f))  # one-char fractions: ½ ⅓ ¾ ...
_SUPER_RE = re.compile(f"[{''.join(_SUPER)}]+")
_SUB_RE = re.compile(f"[{''.join(_SUB)}]+")
_VULGAR_RE = re.compile(f"(\\d?)([{_VULGAR}])")
_SUPER_DIGITS, _SUB_DIGITS = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079", "".join(_SUB)[:10]
_SUPSUB_FRAC_RE = re.compile(  # ¹⁄₁₆, 1¹⁄₁₆: any fraction; not after a letter or bracket (x²⁄₃ is not x times 2/3)
    f"(?<![A-Za-z)\\]}}])(\\d?)([{_SUPER_DIGITS}]+)[\u2044\u2215/]([{_SUB_DIGITS}]+)")
_OTHER_DIGIT_RE = re.compile(r"(?![0-9])\d")  # any Unicode decimal digit that is not ASCII
_ASCII_OTHER = {"\u2044": "/", "\u2215": "/", "\u066b": ".", "\u066c": ",", "\u00d7": "\\times "}


def _has_any(text: str, chars: str) -> bool:
    return any(c in text for c in chars)  # str.__contains__ is a C-speed scan per char; a regex is ~10x slower


def _vulgar(m: re.Match) -> str:
    num, _, den = unicodedata.normalize("NFKC", m.group(2)).partition("\u2044")
    return f"{m.group(1)}{'+' if m.group(1) else ''}\\frac{{{num}}}{{{den}}}"


def _supsub_fraction(m: re.Match) -> str:
    num, den = "".join(_SUPER[c] for c in m.group(2)), "".join(_SUB[c] for c in m.group(3))
    return f"{m.group(1)}{'+' if m.group(1) else ''}\\frac{{{num}}}{{{den}}}"


def normalize_unicode(text: str) -> str:
    """`text` with numerals in ASCII (NFKC, Unicode TR15, plus the mappings NFKC lacks).

    Minus signs -> ``-``, any script's digits -> ``0-9``, superscripts -> ``^{...}``, fractions -> ``\\frac{a}{b}``
    (``3½`` -> ``3+\\frac{1}{2}``), digit-group spaces and invisible marks removed. TypeError on a non-str."""
    if not isinstance(text, str):
        raise TypeError(f"normalize_unicode: text must be a str, got {type(text).__name__}")
    if text.isascii():
        return text
    for c in _INVISIBLE:
        if c in text:
            text = text.replace(c, "")
    if _has_any(text, _GROUP_SPACES):
        text = _GROUP_SPACE_RE.sub("", text)
    for c in _MINUSES:
        if c in text:
            text = text.replace(c, "-")
    if "\u2013" in text:
        text = _EN_DASH_RE.sub("-", text)
    if _has_any(text, _SUB_DIGITS) and _has_any(text, _SUPER_DIGITS):
        text = _SUPSUB_FRAC_RE.sub(_supsub_fraction, text)
    if _has_any(text, "".join(_SUPER)):
        text = _SUPER_RE.sub(lambda m: "^{" + "".join(_SUPER[c] for c in m.group()) + "}", text)
    if _has_any(text, "".join(_SUB)):
        text = _SUB_RE.sub(lambda m: "_{" + "".join(_SUB[c] for c in m.group()) + "}", text)
    if _has_any(text, _VULGAR):
        text = _VULGAR_RE.sub(_vulgar, text)
    for c, ascii_ in _ASCII_OTHER.items():
        if c in text:
            text = text.replace(c, ascii_)
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return text if text.isascii() else _OTHER_DIGIT_RE.sub(lambda m: str(unicodedata.decimal(m.group())), text)


# ------------------------------------------------------------------------------------ reasoning
THINK_TAGS = ("<think>", "</think>")  # default (open, close) tags of a reasoning trace (DeepSeek-R1, Qwen3)


def strip_reasoning(text: str, tags: tuple[str, str] | None = THINK_TAGS) -> str:
    """The reply after its last closing think tag (``tags[1]``), so numbers in the trace are never the answer.

    A reply that opens ``tags[0]`` and never closes it gives ""; one without tags is returned as is; `tags=None`
    turns this off. Raises ValueError on malformed `tags`."""
    if tags is None:
        return text
    if (not isinstance(tags, tuple) or len(tags) != 2 or not all(isinstance(t, str) and t for t in tags)):
        raise ValueError(f"reasoning tags must be a pair of non-empty str (open, close), got {tags!r}")
    end = text.rfind(tags[1])
    if end >= 0:
        return text[end + len(tags[1]):]
    return "" if text.lstrip().startswith(tags[0]) else text


# ------------------------------------------------------------------------------------ units
# The one list of units stripped from the end of an answer (those GSM8K solutions and MATH answers write). No
# single letters (m, g, s, h, l, i, e ...): those are variables or constants.
UNITS = (
    "%", "percent", "percentage points", "dollars", "dollar", "cents", "cent", "euros", "euro", "pounds", "pound",
    "mm", "cm", "km", "meters", "meter", "metres", "metre", "inches", "inch", "in.", "feet", "foot", "ft",
    "yards", "yard", "miles", "mile", "mg", "kg", "grams", "gram", "kilograms", "kilogram", "lbs", "lb",
    "ounces", "ounce", "oz", "tons", "ton", "ml", "mL", "liters", "liter", "litres", "litre", "gallons", "gallon",
    "cups", "cup", "seconds", "second", "sec", "minutes", "minute", "mins", "min", "hours", "hour", "hrs", "hr",
    "days", "day", "weeks", "week", "months", "month", "years", "year", "mph", "km/h", "m/s", "kph",
    "degrees", "degree", "\\circ", "^\\circ", "^{\\circ}", "°", "units", "unit", "square units", "square feet",
    "square meters", "square inches", "square centimeters", "sq ft", "cubic feet", "cubic units", "cubic meters",
    "cubic centimeters", "cm^2", "cm^{2}", "ft^2", "ft^{2}", "cm^3", "cm^{3}", "\\%",
)
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_UNIT_POWER = r"(?:\^\s*\{?\s*[23]\s*\}?)?"  # \text{ cm}^2, \mbox{ inches}^{3} (MATH answers)
_UNIT_TAIL_RE = re.compile(  # spacing (\, \; \! ~ or white space), then a unit, plain or wrapped
    rf"(?:\\[,;:! ]|\s|~)*(?:\\(?:text|mbox|mathrm|textrm)\{{[\s~]*(?:{_UNIT_ALT})\s*\}}{_UNIT_POWER}|(?:{_UNIT_ALT}))\Z")
_UNIT_WINDOW = 48  # longest unit with its \text{...} wrapper and spacing, in chars


def strip_unit(answer: str) -> str:
    """`answer` without one trailing unit from `UNITS`, when something remains before it.

    ``42 dollars`` -> ``42``, ``6\\text{ cm}^2`` -> ``6``, ``30^\\circ`` -> ``30``; ``3x``, ``dollars``, ``3xcm`` stay.
    Reads only the last `_UNIT_WINDOW` chars, so the cost does not grow with len(answer)."""
    tail = answer[-_UNIT_WINDOW:]
    m = _UNIT_TAIL_RE.search(tail)
    if m is None:
        return answer
    head = answer[: len(answer) - len(tail) + m.start()].rstrip()
    if not head or (head[-1].isalpha() and m.group()[:1].isalpha()):
        return answer  # nothing before the unit, or the unit is glued to a word: keep
    return head


# ------------------------------------------------------------------------------------ answers
def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: "$1,234.00" -> "1234", "42 dollars" -> "42", "\\frac{1}{2}" as is.

    Numerals made ASCII; math delimiters, ``$``, thousands commas, one unit (`strip_unit`), ``.0``, a trailing
    period and markdown ``**``/backticks dropped; other letters stay (``3x``). Linear in len(answer)."""
    s = normalize_unicode(answer).strip().strip("*`").strip()  # markdown emphasis / code: "**18**"
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right):
            s = s[len(left):-len(right)]
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[!,;: ]", "", s).strip().rstrip(".").strip()
    s = strip_unit(s).rstrip(".").strip()
    if _NUMBER_RE.fullmatch(s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".") or "0"
        if s in ("-0", "-"):
            s = "0"
    return s


def as_fraction(s: str) -> fractions.Fraction | None:
    """Exact value of a plain number, ``a/b`` or ``\\frac{a}{b}`` (normalised input), else None."""
    if len(s) <= MAX_ANSWER_CHARS and re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+|-?\d+/\d+", s):
        try:
            return fractions.Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRAC_RE.match(s) if len(s) <= MAX_ANSWER_CHARS else None
    if m and int(m.group(3)) != 0:
        return fractions.Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    return None


def fractions_equal(p: str, fp: fractions.Fraction, g: str, fg: fractions.Fraction) -> bool:
    """Exact, except a decimal against a value with no finite decimal (1/3): relative REL_TOL."""
    def terminating(f: fractions.Fraction) -> bool:
        q = f.denominator
        for k in (2, 5):
            while q % k == 0:
                q //= k
        return q == 1

    if ("." in p and not terminating(fg)) or ("." in g and not terminating(fp)):
        return abs(fp - fg) <= REL_TOL * max(abs(fp), abs(fg))
    return fp == fg


# a numeric power tower: a power whose exponent is itself a number raised to a power (9^{9^9}, 2^3^4, 2**2**40);
# symbolic ones (e^{x^2}, 2^{n^2}) are cheap for sympy and compared
_TOWER_RE = re.compile(r"\^\s*\{\s*[-+(]*\s*\d[\d.]*\s*\)?\s*\}?\s*\^|\^\s*\d[\d.]*\s*\^"
                       r"|\*\*\s*\(?\s*[\d.]+\s*\)?\s*\*\*")


def too_costly(expr: str) -> bool:
    """Whether symbolic evaluation of `expr` is refused up front, so runaway answers rarely cost a worker.

    Refused: over MAX_SYMBOLIC_CHARS, a numeric power tower (``2^3^4``), a 4+ digit exponent, a factorial of
    anything but a literal < 1000."""
    if len(expr) > MAX_SYMBOLIC_CHARS or _TOWER_RE.search(expr):
        return True
    if re.search(r"\^\s*\{?\s*[-+]?\d{4,}", expr):
        return True
    return any(not re.search(r"(?<!\d)\d{1,3}\s*$", expr[:m.start()]) for m in re.finditer(r"!(?!=)", expr))
