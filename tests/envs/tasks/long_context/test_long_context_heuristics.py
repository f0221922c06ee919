"""Gaming floors of the long-context families on 200 held-out tasks per family at 8k tokens (approximate counter; the
heuristics read text, not tokens): every heuristic <= 0.05 per question type, the lexical oracle <= 0.10 where the
answer is not a cell or a needle read off a line."""
import pytest
from long_context_cases import FAMILIES, generate

from envs.tasks.long_context import heuristics

TASKS, TRAIN_TASKS, TARGET = 200, 50, 8192
LEXICAL_BY_DESIGN = {"extraction", "multikey_needle"}  # a cell or a needle is read off the line that names it


def _document(text):
    return {"prompt": f"HEAD\n\n{text}\n\nQ", "document": [6, 6 + len(text)], "question": "What is X in 2020?",
            "keys": ["Revenue", "2020"]}


def test_heuristics_read_the_document():
    task = _document("Intro 7 and 1,234.\n| Revenue | 5,000 | 4,000 |\nRevenue in 2020 was 2020 then 3,100.\n"
                     "Net 7 end 42")
    assert heuristics.first_number(task) == "7"
    assert heuristics.last_number(task) == "42"
    assert heuristics.most_frequent_number(task) == "7"
    assert heuristics.copy_question(task) == "What is X in 2020?"
    assert heuristics.lexical_oracle(task) == "3100"  # the line naming item and year; the year itself skipped
    assert heuristics.lexical_oracle({**task, "keys": ["Revenue", "2019"]}) == "5000"  # else the item's line
    assert heuristics.lexical_oracle({**task, "keys": []}) == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_no_heuristic_answers_without_reading(family):
    tasks = generate(family, TASKS, TARGET)
    train = generate(family, TRAIN_TASKS, TARGET, split="train")
    table = heuristics.floor_table(tasks, train)
    print(family, {h: {k: round(v, 3) for k, v in row.items()} for h, row in table.items()})
    assert set(table["constant"]) == set(FAMILIES[family][1])
    for name, row in table.items():
        for kind, floor in row.items():
            if name == "lexical_oracle":
                assert kind in LEXICAL_BY_DESIGN or floor <= 0.10, (name, kind, floor)
            else:
                assert floor <= 0.05, (name, kind, floor)


def test_floor_table_needs_tasks():
    with pytest.raises(ValueError, match="at least one task"):
        heuristics.floor_table([], [])
