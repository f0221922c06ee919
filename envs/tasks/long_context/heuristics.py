"""Gaming floors of the long-context families: replies made without reading carefully, and their mean rewards.

Heuristics: a constant answer (the most frequent gold answers of a train sample, "0", "1"), the first, last and
most frequent number of the document, the question copied back, and the lexical oracle: the first number on the
first line that names every search term of the question (its line item and year), else its first term.
"""
from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Iterable, Mapping

from envs.tasks.long_context import lengths

NUMBER_RE = re.compile(r"(?<![\w])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
FIXED_CONSTANTS = ("0", "1")
TOP_GOLD = 3


def document(task: Mapping) -> str:
    """The document part of a task's prompt."""
    start, end = task["document"]
    return task["prompt"][start:end]


@functools.lru_cache(maxsize=8)
def _numbers(text: str) -> tuple[str, ...]:
    return tuple(NUMBER_RE.findall(text))  # as written: "1,234" (commas dropped from the chosen one only)


def first_number(task: Mapping) -> str:
    """The document's first number ("" when it has none)."""
    match = NUMBER_RE.search(document(task))
    return match.group().replace(",", "") if match else ""


def last_number(task: Mapping) -> str:
    """The document's last number."""
    numbers = _numbers(document(task))
    return numbers[-1].replace(",", "") if numbers else ""


def most_frequent_number(task: Mapping) -> str:
    """The document's most frequent number (the first seen among ties)."""
    numbers = _numbers(document(task))
    return collections.Counter(numbers).most_common(1)[0][0].replace(",", "") if numbers else ""


def copy_question(task: Mapping) -> str:
    """The question itself."""
    return task["question"]


def lexical_oracle(task: Mapping) -> str:
    """The lexical oracle's reply: the first number on the first line that names all of the task's `keys`.

    Case-insensitive; the search terms themselves (a year) are skipped; without such a line, the first line naming
    its first key; "" without keys or such a line."""
    keys = [k.lower() for k in task["keys"]]
    if not keys:
        return ""
    lines = document(task).split("\n")
    lowered = [line.lower() for line in lines]
    for wanted in (keys, keys[:1]):
        for line, low in zip(lines, lowered):
            if all(k in low for k in wanted):
                found = [n.replace(",", "") for n in _numbers(line) if n.replace(",", "") not in keys]
                if found:
                    return found[0]
    return ""


HEURISTICS: dict[str, Callable[[Mapping], str]] = {
    "first_number": first_number, "last_number": last_number, "most_frequent_number": most_frequent_number,
    "copy_question": copy_question, "lexical_oracle": lexical_oracle}


def constants(train_tasks: Iterable[Mapping]) -> list[str]:
    """The constant answers tried: the TOP_GOLD most frequent gold answers of `train_tasks`, then FIXED_CONSTANTS."""
    counts = collections.Counter(t["answer"] for t in train_tasks)
    return list(dict.fromkeys([a for a, _ in counts.most_common(TOP_GOLD)] + list(FIXED_CONSTANTS)))


def floor_table(tasks: list[Mapping], train_tasks: list[Mapping]) -> dict[str, dict[str, float]]:
    """The mean reward of every heuristic on `tasks`: {heuristic: {question type: mean reward}}.

    "constant" is the best constant of `train_tasks` on each type; every reply is wrapped in <answer> tags and
    scored by the task's verifier. Raises ValueError for no tasks."""
    if not tasks:
        raise ValueError("floor_table needs at least one task")
    by_type: dict[str, list[Mapping]] = collections.defaultdict(list)
    for t in tasks:
        by_type[t["type"]].append(t)

    def mean(replies: Callable[[Mapping], str], group: list[Mapping]) -> float:
        return sum(lengths.score_reply(t, f"<answer>{replies(t)}</answer>").reward for t in group) / len(group)

    table = {name: {kind: mean(fn, group) for kind, group in by_type.items()} for name, fn in HEURISTICS.items()}
    tried = constants(train_tasks)
    table["constant"] = {kind: max(mean(lambda t, c=c: c, group) for c in tried) for kind, group in by_type.items()}
    return table
