"""Answers in ``<answer>...</answer>`` tags, and a conservative reader of replies that have none.

The convention of reasoning-gym (arXiv:2505.24760) and R1-style prompts; small instruct models (SmolLM2-135M)
ignore the tag instruction, hence `fallback_answer`. Pure functions, no JAX; never raise on odd text.
"""
from __future__ import annotations

import re

from envs.verify import answers

_ANSWER_PHRASE_RE = re.compile(r"\banswer\b.*?(?:\bis\b\s*:?|:|=)\s*(.*)$", re.I)  # "the (final) answer ... is/:/= X"
_IS_LAST_RE = re.compile(r"\bis\s+(\S+)$")  # "... is X" (X one token)
_WRAPPERS = " \t*_`\"'$"
FALLBACK_MAX_LINE = 1000  # a longer last line is not read by the fallback (bounded regex work)


def _clean(candidate: str) -> str | None:
    """`candidate` without markdown/quote wrappers and one trailing period; None when empty or too long."""
    text = candidate.strip().strip(_WRAPPERS)
    if text[-1:] in (".", "!"):
        text = text[:-1].rstrip().strip(_WRAPPERS)
    return text if text and len(text) <= answers.MAX_ANSWER_CHARS else None


def fallback_answer(reply: str) -> tuple[str | None, str]:
    """(answer, form) read from the LAST non-empty line of a reply that has no answer tag, or (None, "none").

    Only the last line is read, so an answer a later line revises never scores. Forms, in order: "boxed"
    (``\\boxed{X}``), "phrase" ("Answer: X", "the answer is X"), "equation" ("... = X"), "is" ("... is X."), "bare"
    (the line); X after an "=" and in "is"/"bare" is one token. Markdown wrappers and a final "." are dropped."""
    lines = [line for line in reply.splitlines() if line.strip()]
    if not lines or len(lines[-1]) > FALLBACK_MAX_LINE:
        return None, "none"
    line = lines[-1].strip()
    if "\\boxed" in line or "\\fbox" in line:
        boxed = answers.extract_boxed(line)
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


def read_answer(text: str, think_tags: tuple[str, str] | None = answers.THINK_TAGS, *,
                fallback: bool = True) -> tuple[str | None, str]:
    """(answer, method) of a reply: the last ``<answer>...</answer>`` after the reasoning block ("answer_tag").

    With no answer tag at all and `fallback`, `fallback_answer` decides (method "fallback_<form>"); an unclosed or
    empty tag reads (None, "none"). Never raises on odd text."""
    if not isinstance(text, str):
        return None, "none"
    reply = answers.strip_reasoning(text, think_tags)
    if "<answer>" in reply or "</answer>" in reply:
        answer = answers.extract_tag(reply, "answer")
        return (answer, "answer_tag") if answer is not None else (None, "none")
    if not fallback:
        return None, "none"
    answer, form = fallback_answer(reply)
    return (answer, f"fallback_{form}") if answer is not None else (None, "none")
