"""LongSynthetic-v0's answers recomputed from the prompt alone: the needle named by the question, the variables a
chain of assignments gives the value, the three most frequent words of the word list."""
import collections
import re

import pytest
from long_context_cases import generate

from envs.tasks.long_context import synthetic

ASSIGNMENT_RES = [re.compile(p) for p in (r"VAR ([A-Z]{5}) = (\w+)", r"([A-Z]{5}) := (\w+)",
                                          r"Let ([A-Z]{5}) equal (\w+)\.", r"Set variable ([A-Z]{5}) to (\w+)\.")]


@pytest.fixture(scope="module")
def synthetic_tasks():
    return generate("synthetic", 90, 8192)


def _of_type(tasks, kind):
    chosen = [t for t in tasks if t["type"] == kind]
    assert chosen
    return chosen


def test_the_asked_needle_is_the_only_one_with_its_key(synthetic_tasks):
    for t in _of_type(synthetic_tasks, "multikey_needle"):
        key = t["keys"][0]
        lines = [line for line in t["prompt"].split("\n") if re.search(rf"(?<![\w-]){key}(?![\w-])", line)]
        needles = [line for line in lines if "magic number" in line and not line.startswith("Question:")]
        assert len(needles) == 1 and re.findall(r"\d{7}", needles[0]) == [t["answer"]], t["id"]
        assert sum("magic number" in line for line in t["prompt"].split("\n")) >= 5  # 3+ distractor needles


def test_variable_tracking_answer_follows_the_assignments(synthetic_tasks):
    for t in _of_type(synthetic_tasks, "variable_tracking"):
        value = re.search(r"\d{5}", t["question"]).group()
        assigned = {}
        for pattern in ASSIGNMENT_RES:
            assigned.update(pattern.findall(t["prompt"]))
        resolved = {}
        for name, source in assigned.items():
            while source in assigned:
                source = assigned[source]
            resolved[name] = source
        assert t["answer"] == ", ".join(sorted(n for n, v in resolved.items() if v == value)), t["id"]
        assert len({v for v in resolved.values()}) >= 3  # distractor chains with other values


def test_common_words_are_the_three_most_frequent(synthetic_tasks):
    for t in _of_type(synthetic_tasks, "common_words"):
        words = [w for s, e in t["evidence"][1:] for w in t["prompt"][s:e].split(", ")]
        ranked = collections.Counter(words).most_common()
        assert ranked[2][1] > ranked[3][1], t["id"]
        assert t["answer"] == ", ".join(sorted(w for w, _ in ranked[:3])), t["id"]
        assert {w + "e" for w, _ in ranked[:3]} <= set(words)  # the look-alikes are there


def test_filler_sentences_vary():
    blocks, _ = synthetic.filler(__import__("random").Random(0))
    sentences = [s for _ in range(50) for s in blocks()[0].split(". ")]
    assert len(set(sentences)) > 0.95 * len(sentences)
