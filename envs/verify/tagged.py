"""Answers in ``<answer>...</answer>`` tags, and a conservative reader of replies that have none.

The convention of reasoning-gym (Stojanovski et al. 2025, arXiv:2505.24760) and of R1-style prompts: the reply
after the last ``</think>`` (`answers.strip_reasoning`) is searched for the last ``<answer>...</answer>``
(`answers.extract_tag`, the one tag extractor; multi-line answers kept). Small instruct models
(SmolLM2-135M-Instruct) ignore the tag instruction and write "The answer is 12.", so a reply with no tag at all
may be read from its last non-empty line (`fallback_answer`). Pure functions, no JAX; never raise on odd text.
"""
from __future__ import annotations

import re

from envs.verify import answers as verifiers

_ANSWER_PHRASE_RE = re.compile(r"\banswer\b.*?(?:\bis\b\s*:?|:|=)\s*(.*)$", re.I)  # "the (final) answer ... is/:/= X"
_IS_LAST_RE = re.compile(r"\bis\s+(\S+)$")  # "... is X" (X one token)
_WRAPPERS = " \t*_`\"'$"
FALLBACK_MAX_LINE = 1000  # a longer last line is not read by the fallback (bounded regex work)


def _clean(candidate: str) -> str | None:
    """`candidate` without markdown/quote wrappers and one trailing sentence period; None when empty or longer
    than `verifiers.MAX_ANSWER_CHARS`."""
    text = candidate.strip().strip(_WRAPPERS)
    if text[-1:] in (".", "!"):
        text = text[:-1].rstrip().strip(_WRAPPERS)
    return text if text and len(text) <= verifiers.MAX_ANSWER_CHARS else None


def fallback_answer(reply: str) -> tuple[str | None, str]:
    """(answer, form) read from the LAST non-empty line of a reply that has no answer tag, or (None, "none").

    For small instruct models that ignore the tag instruction (SmolLM2-135M-Instruct writes "The answer is 12.",
    "3 * 4 = 12" or "The LCM of 4 and 6 is 12."). Only the last line is read, so an answer that a later line
    revises never scores; nothing is searched for the gold answer. Forms, in order:
      "boxed":    the last ``\\boxed{X}`` on that line -> X
      "phrase":   "... answer ... is X" / "Answer: X" / "answer = X" -> X (the rest of the line after the first
                  is/:/= that follows the word "answer"; after its last "=" when it holds one, e.g. "is 3+4 = 7")
      "equation": "... = X" with X one token (no space) -> X (after the last "=")
      "is":       "... is X." with X one token -> X
      "bare":     the line is one token -> that token
    The result drops markdown/quote wrappers (``**``, backticks, quotes, ``$``) and one trailing "." or "!".
    Multi-line answers need the tags.
    """
    lines = [line for line in reply.splitlines() if line.strip()]
    if not lines or len(lines[-1]) > FALLBACK_MAX_LINE:
        return None, "none"
    line = lines[-1].strip()
    if "\\boxed" in line or "\\fbox" in line:
        boxed = verifiers.extract_boxed(line)
        return (None, "none") if boxed is None else (_clean(boxed), "boxed")
    m = _ANSWER_PHRASE_RE.search(line)
    if m:
        phrase = m.group(1)
        if "=" in phrase:  # "The answer is 3 + 4 = 7." -> 7
            rhs = _clean(phrase.rsplit("=", 1)[1])
            return (rhs, "phrase") if rhs is not None and not any(c.isspace() for c in rhs) else (None, "none")
        return _clean(phrase), "phrase"
    if "=" in line:
        rhs = _clean(line.rsplit("=", 1)[1])
        return (rhs, "equation") if rhs is not None and not any(c.isspace() for c in rhs) else (None, "none")
    m = _IS_LAST_RE.search(line)
    if m:
        return _clean(m.group(1)), "is"
    bare = _clean(line)
    return (bare, "bare") if bare is not None and not any(c.isspace() for c in bare) else (None, "none")


def read_answer(text: str, think_tags: tuple[str, str] | None = verifiers.THINK_TAGS, *,
                fallback: bool = True) -> tuple[str | None, str]:
    """(answer, method) of a reply: the last ``<answer>...</answer>`` after the reasoning block (method
    "answer_tag"); when the reply (after its reasoning block) has no ``<answer>`` tag at all and `fallback`,
    `fallback_answer` on it (method "fallback_<form>"); else (None, "none"). A reply with an opened but
    unclosed or empty tag is not read by the fallback. Never raises on odd text."""
    if not isinstance(text, str):
        return None, "none"
    reply = verifiers.strip_reasoning(text, think_tags)
    if "<answer>" in reply or "</answer>" in reply:
        answer = verifiers.extract_tag(reply, "answer")
        return (answer, "answer_tag") if answer is not None else (None, "none")
    if not fallback:
        return None, "none"
    answer, form = fallback_answer(reply)
    return (answer, f"fallback_{form}") if answer is not None else (None, "none")
