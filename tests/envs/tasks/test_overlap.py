"""Tests for envs/tasks/overlap.py: exact and near-duplicate task prompts and evaluation contamination."""
import json
import os
import random
import time

import pytest

from envs.tasks import overlap
from envs.tasks.overlap import contamination, exact_duplicates, near_duplicates, normalize_text, tokens

GSM8K_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4, "shared", "data", "gsm8k")
EVAL = [  # 15 to 40 words each
    ("A baker makes 24 loaves of bread every morning and sells each loaf for 3 dollars. How much money does the "
     "baker earn in a week?"),
    ("Maria reads 15 pages of her novel on weekdays and 40 pages on each weekend day. How many pages does she read "
     "over two full weeks?"),
    ("A train leaves the station at noon travelling at 80 kilometres per hour toward a city that is 200 kilometres "
     "away. At what time does it arrive?"),
    "Tom has twice as many marbles as Jerry, and together they have 45 marbles. How many marbles does Tom have?",
    ("The school garden has 6 rows of tomato plants with 14 plants in each row, and every plant gives 5 tomatoes. "
     "How many tomatoes does the garden give in total?"),
]
TRAIN = [
    "A farmer has 17 sheep and buys 8 more at the market on Saturday. How many sheep does the farmer own now?",
    "Lena saves 12 dollars each week for a bicycle that costs 180 dollars. How many weeks must she save?",
    "A rectangle is 9 metres long and 4 metres wide. What is the area of the rectangle in square metres?",
    "Write a short poem about the sea at dawn, using at least three colours and no more than eight lines.",
    "Sort the following words in alphabetical order: pear, apple, quince, banana, cherry.",
]
SENTENCE_40 = ("During the long summer holidays the three cousins built a wooden raft from old barrels and planks, "
               "painted it bright orange, and sailed it slowly across the quiet lake behind their grandmother's "
               "farmhouse while the dogs barked from the shore")


def rows_of(texts, prefix):
    return [(f"{prefix}{i}", text) for i, text in enumerate(texts)]


def change_word(text, new="purple"):
    """Replace the middle word of ``text`` (not a number) with ``new``."""
    words = text.split()
    k = len(words) // 2
    while any(c.isdigit() for c in words[k]):
        k += 1
    words[k] = new
    return " ".join(words)


def test_normalize_text_and_tokens():
    assert normalize_text("  Hello,\tWORLD!!  “Quoted” — x ") == "hello world quoted x"
    assert normalize_text("ＡＢＣ１２ costs $5; 3.5 kg.") == "abc12 costs $5 3 point 5 kg"  # NFKC folds width
    assert tokens("It's  2 + 2 = 4?") == ["its", "2", "plus", "2", "equals", "4"]
    # math signs are words: different problems stay different, a spelled-out sign equals the symbol
    assert normalize_text("Calculate 9 / 1.") != normalize_text("Calculate -9 * -1.")
    assert normalize_text("What is 5 - 3?") == normalize_text("what is 5 minus 3")
    assert normalize_text("a well-known (x)") == "a wellknown x"  # signs touching letters are punctuation
    with pytest.raises(TypeError, match="expected str"):
        normalize_text(None)


def test_eval_prompts_copied_with_changed_case_space_punctuation_are_exact():
    reference = rows_of(EVAL, "eval-")
    copies = [" ".join(p.upper().replace(".", " . ").replace("?", "!!").split()) + "  " for p in EVAL]
    copies = ["\n" + c.replace(" ", "   ", 3).replace(",", ";") for c in copies]
    train = rows_of(TRAIN, "train-") + rows_of(copies, "copy-")
    found = contamination(train, reference)
    assert {(o.a, o.b) for o in found} == {(f"copy-{i}", f"eval-{i}") for i in range(5)}
    assert all(o.kind == "exact" and o.score == 1.0 for o in found)
    assert [(o.a, o.b, o.score) for o in exact_duplicates(reference + train)] == [
        (f"copy-{i}", f"eval-{i}", 1.0) for i in range(5)]
    assert exact_duplicates(reference + train)[0].detail == normalize_text(EVAL[0])[:77] + "..."


def test_exact_duplicates_point_at_the_earliest_row():
    rows = [("r0", "Add 2 and 3."), ("r1", "Something else entirely."), ("r2", "add 2 AND 3"),
            ("r3", "Add 2 and 3!"), ("r4", "Add 2 and 4.")]
    assert [(o.a, o.b, o.kind) for o in exact_duplicates(rows)] == [("r2", "r0", "exact"), ("r3", "r0", "exact")]
    assert exact_duplicates(rows[:2]) == []


@pytest.mark.parametrize("words", [15, 25, 40])
def test_one_word_changed_is_a_near_duplicate(words):
    original = " ".join(SENTENCE_40.split()[:words])
    rows = rows_of(TRAIN, "t") + [("orig", original)] + rows_of(EVAL, "e") + [("changed", change_word(original))]
    found = near_duplicates(rows)
    assert [(o.a, o.b, o.kind) for o in found] == [("changed", "orig", "near_duplicate")]
    assert overlap.NEAR_THRESHOLD <= found[0].score < 1.0
    assert "purple" in found[0].detail
    against_eval = contamination([("changed", change_word(original))], rows_of(EVAL, "e") + [("orig", original)])
    # Every 13-gram of 25 words holds the middle one; 40 words keep 15 unchanged 13-grams, the stronger evidence.
    kind = "ngram" if words == 40 else "near_duplicate"
    assert [(o.a, o.b, o.kind) for o in against_eval] == [("changed", "orig", kind)]
    assert 0 < against_eval[0].score < 1.0


def test_near_duplicates_of_eval_prompts_and_what_is_not_one():
    changed = [change_word(p) for p in EVAL]
    found = contamination(rows_of(changed, "c"), rows_of(EVAL, "e"), n=50)  # n-grams off: the near rule alone
    assert {(o.a, o.b, o.kind) for o in found} == {(f"c{i}", f"e{i}", "near_duplicate") for i in range(5)}
    within = near_duplicates(rows_of(EVAL + changed, "r"))
    assert [(o.a, o.b) for o in within] == [(f"r{i + 5}", f"r{i}") for i in range(5)]
    # A different number is a different problem; a short prompt has no near-duplicates; exact repeats are left out.
    assert near_duplicates([("a", EVAL[1]), ("b", EVAL[1].replace("15 pages", "16 pages"))]) == []
    assert near_duplicates([("a", "What is the capital of France?"), ("b", "What is the capital of Spain?")]) == []
    assert near_duplicates([("a", EVAL[0]), ("b", EVAL[0].upper())]) == []


def test_one_overlap_per_pair_with_the_strongest_kind():
    long_eval = EVAL[2] + " Answer in hours and minutes."
    reference = [("e0", EVAL[2]), ("e1", long_eval), ("e2", change_word(EVAL[2], "slowly"))]
    found = contamination([("t0", EVAL[2]), ("t1", TRAIN[0])], reference)
    assert [(o.a, o.b, o.kind) for o in found] == [("t0", "e0", "exact"), ("t0", "e1", "ngram"),
                                                    ("t0", "e2", "ngram")]
    assert found[1].score == 1.0 and found[1].detail.startswith("a train leaves the station")


def test_a_template_is_not_contamination_but_a_copied_prompt_is():
    template = "Your task is to sort words in ascending order using ASCII ordering and return them as a list: {}"
    vocab = [f"{a}{b}" for a in ("mar", "tel", "sun", "gro", "pli") for b in ("ket", "lo", "ba", "dine", "rum")]
    rng = random.Random(0)
    rows = [template.format(", ".join(rng.sample(vocab, 4))) for _ in range(60)]
    train, reference = rows_of(rows[:30], "t"), rows_of(rows[30:], "e")
    assert contamination(train, reference) == []
    planted = ("copied", "Question: " + rows[40] + ". Think step by step.")
    assert [(o.a, o.b, o.kind) for o in contamination(train + [planted], reference)] == [("copied", "e10", "ngram")]


def test_bad_input_is_one_clear_error():
    with pytest.raises(TypeError, match=r"rows\[1\]"):
        exact_duplicates([("a", "x"), ("b", 3)])
    with pytest.raises(TypeError, match=r"reference\[0\]"):
        contamination([("a", "x")], ["just text"])
    with pytest.raises(ValueError, match="threshold"):
        near_duplicates([("a", "x")], threshold=1.5)
    with pytest.raises(ValueError, match="num_perm"):
        near_duplicates([("a", "x")], num_perm=4)
    with pytest.raises(ValueError, match="n must be"):
        contamination([("a", "x")], [("b", "y")], n=0)


def gsm8k(split, limit=None):
    with open(os.path.join(GSM8K_DIR, f"{split}.jsonl"), encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    return questions[:limit]


@pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason=f"{GSM8K_DIR} is absent")
def test_gsm8k_train_rows_are_rarely_flagged_against_test():
    train, test = rows_of(gsm8k("train", 2000), "train-"), rows_of(gsm8k("test"), "test-")
    planted = [("planted", "Question: " + test[7][1] + " Show your work.")]  # a positive control
    found = contamination(train + planted, test)
    flagged = {o.a for o in found} - {"planted"}
    assert len(flagged) <= 0.01 * len(train), sorted(flagged)
    assert ("planted", "test-7", "ngram") in {(o.a, o.b, o.kind) for o in found}
    within = exact_duplicates(train) + near_duplicates(train)
    assert len({o.a for o in within}) <= 0.01 * len(train), within


@pytest.mark.parametrize("name", ["family_relationships", "basic_arithmetic"])
def test_reasoning_gym_rows_of_another_seed_are_rarely_flagged(name):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    # Item i of seed s is drawn from Random(s + i), so seeds 1 and 2 share 499 of 500 items: 10_001 is disjoint.
    seed_a, seed_b = ([x["question"] for x in reasoning_gym.create_dataset(name, seed=s, size=500)]
                      for s in (1, 10_001))
    reference, rows = rows_of(seed_a, "a"), rows_of(seed_b, "b")
    flagged = {o.a for o in contamination(rows, reference)}
    assert len(flagged) <= 5, sorted(flagged)
    within = near_duplicates(reference + rows)
    assert len({o.a for o in within}) <= 5, within


def test_speed_and_determinism():
    rng = random.Random(0)
    vocab = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
                    for _ in range(6000)})
    rows = [(f"r{i}", " ".join(rng.choices(vocab, k=40))) for i in range(4000)]
    planted = [(f"near{k}", change_word(rows[k][1], "changed")) for k in range(0, 4000, 100)]
    planted += [(f"same{k}", rows[k][1].title()) for k in range(0, 4000, 100)]
    start = time.perf_counter()
    exact, near = exact_duplicates(rows + planted), near_duplicates(rows + planted)
    elapsed = time.perf_counter() - start
    assert {(o.a, o.b) for o in exact} == {(f"same{k}", f"r{k}") for k in range(0, 4000, 100)}
    assert {(o.a, o.b) for o in near} == {(f"near{k}", f"r{k}") for k in range(0, 4000, 100)}
    assert elapsed < 6.0  # 20k rows in < 30 s, scaled
    assert near_duplicates(rows + planted) == near
