"""What every long-context family promises: golden answers score 1, lengths within 5% of the target in SmolLM2's
tokenizer, the evidence at the requested depth, determinism, disjoint splits and planted distractors.

Default tier: 200 tasks per family at 1k tokens and 50 at 8k (200 at 8k would take ~15 s of tokenizing). The slow
tier: 20 tasks per family at 64k, and three 1,048,576-token tasks built in at most 10 s.
"""
import random
import time

import pytest
from long_context_cases import FAMILIES, generate

from envs.tasks.long_context import lengths

TOLERANCE = 0.05
_CACHE = {}


def _tasks(family, n, target, count):
    key = (family, n, target)
    if key not in _CACHE:
        _CACHE[key] = generate(family, n, target, count)
    return _CACHE[key]


def _wrong(task):
    return str(int(task["answer"]) + 1) if task["verifier"]["name"] == "numeric" else "not " + task["answer"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("n", "target"), [(200, 1024), (50, 8192)])
def test_golden_answers_score_one_and_lengths_hit_the_target(family, n, target, smollm2_count):
    tasks = _tasks(family, n, target, smollm2_count)
    assert {t["type"] for t in tasks} == set(FAMILIES[family][1])
    for t in tasks:
        assert lengths.score_reply(t, f"<answer>{t['answer']}</answer>").reward == 1.0, t["id"]
        assert lengths.score_reply(t, f"<answer>{_wrong(t)}</answer>").reward == 0.0, t["id"]
        assert abs(smollm2_count(t["prompt"]) - target) <= TOLERANCE * target, t["id"]
        assert abs(t["num_tokens"] - target) <= TOLERANCE * target


@pytest.mark.parametrize("family", FAMILIES)
def test_accepted_spellings_score_one(family):
    for t in generate(family, 12, 1024):
        for answer in t["accepted"]:
            assert lengths.score_reply(t, f"Done.\n<answer>{answer.upper()}</answer>").reward == 1.0, t["id"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_evidence_sits_at_the_requested_depth(family, depth, smollm2_count):
    """The first evidence piece starts at `depth` of the document's tokens, or as late as all the evidence fits."""
    for t in generate(family, len(FAMILIES[family][1]), 8192, smollm2_count, depth=depth):
        doc_start, doc_end = t["document"]
        start = t["evidence"][0][0]
        doc_tokens = smollm2_count(t["prompt"][doc_start:doc_end])
        share = sum(smollm2_count(t["prompt"][s:e]) for s, e in t["evidence"]) / doc_tokens
        want = min(depth, 1 - share)
        assert abs(smollm2_count(t["prompt"][doc_start:start]) / doc_tokens - want) < 0.03, t["id"]
        assert abs((start - doc_start) / (doc_end - doc_start) - want) < 0.1, t["id"]  # within a tenth of the text
        for s, e in t["evidence"]:
            assert doc_start <= s < e <= doc_end


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_seed_gives_the_same_task(family):
    first, again = generate(family, 15, 2048), generate(family, 15, 2048)
    assert first == again
    assert len({t["prompt"] for t in first}) == len(first)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_and_test_share_no_document_or_prompt(family):
    test, train = generate(family, 200, 1024), generate(family, 200, 1024, split="train")
    documents = [{t["prompt"][slice(*t["document"])] for t in tasks} for tasks in (test, train)]
    assert not documents[0] & documents[1]
    assert not {t["prompt"] for t in test} & {t["prompt"] for t in train}
    assert not {t["seed"] for t in test} & {t["seed"] for t in train}
    assert generate(family, 5, 1024, split="train", seed=1) != train[:5]  # the train key moves the train split


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", [1000, 8192])
def test_every_question_has_three_near_identical_distractors_in_the_prompt(family, target):
    for t in generate(family, 60, target):
        assert len(t["distractors"]) >= 3, t["id"]
        for d in t["distractors"]:
            shown = d["label"].rsplit(".", 1)[-1].split("(")[0] if family == "codebase" else d["value"]
            assert shown in t["prompt"], (t["id"], d)
            assert d["value"].replace(",", "") != t["answer"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_64k_tasks_hit_length_depth_and_gold(family, smollm2_count):
    for t in generate(family, 20, 65536, smollm2_count):
        assert abs(smollm2_count(t["prompt"]) - 65536) <= TOLERANCE * 65536, t["id"]
        assert abs(t["depth_tokens"] / t["document_tokens"] - t["depth"]) < 0.02, t["id"]
        assert lengths.score_reply(t, f"<answer>{t['answer']}</answer>").reward == 1.0


@pytest.mark.slow
def test_three_million_token_tasks_build_in_ten_seconds(smollm2_count):
    target = lengths.MAX_TARGET_TOKENS
    start = time.perf_counter()
    tasks = [FAMILIES[f][0](7, target_tokens=target, depth=random.Random(f).random(), count_tokens=smollm2_count,
                            kind=FAMILIES[f][1][0]) for f in FAMILIES]
    seconds = time.perf_counter() - start
    print(f"three {target}-token tasks built in {seconds:.2f} s")
    assert seconds <= 10.0
    for t in tasks:  # counted per blank-line piece: a piece's count is its count in context (pieces start unspaced)
        pieces = t["prompt"].split("\n\n")
        counted = smollm2_count(pieces[0]) + sum(smollm2_count("\n\n" + p) for p in pieces[1:])
        assert abs(counted - target) <= TOLERANCE * target, (t["id"], counted)
