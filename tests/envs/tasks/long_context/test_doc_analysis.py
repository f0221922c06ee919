"""DocAnalysis-v0's documents read back from the prompt: tables add up except the one planted inconsistency, and each
question type's answer follows from the tables and prose the prompt shows (parsed here, not taken from the generator).
"""
import re

import pytest
from long_context_cases import generate

from envs.tasks.long_context import documents

TASKS = 150  # 30 per question type, at 8k tokens (approximate counter)


def tables(prompt):
    """{title: (header, {row label: [int cells]})} of every markdown table of the prompt."""
    out = {}
    for block in prompt.split("\n\n"):
        lines = block.split("\n")
        if lines[0].startswith("### ") and len(lines) > 3 and lines[1].startswith("|"):
            header = [c.strip() for c in lines[1].strip("|").split("|")]
            rows = {}
            for line in lines[3:]:
                cells = [c.strip() for c in line.strip("|").split("|")]
                rows[cells[0]] = [int(c.replace(",", "")) for c in cells[1:]]
            out[lines[0][4:]] = (header, rows)
    return out


RELATIONS = {  # table title -> (row, rows it sums with signs)
    "Consolidated statement of income": [
        ("Gross profit", {"Revenue": 1, "Cost of revenue": -1}),
        ("Operating income", {"Gross profit": 1, "Research and development": -1,
                              "Selling, general and administrative": -1}),
        ("Income before income taxes", {"Operating income": 1, "Interest expense": -1}),
        ("Net income", {"Income before income taxes": 1, "Income tax expense": -1})],
    "Consolidated balance sheet": [
        ("Total current assets", {"Cash and cash equivalents": 1, "Accounts receivable": 1, "Inventories": 1}),
        ("Total assets", {"Total current assets": 1, "Property, plant and equipment": 1, "Goodwill": 1}),
        ("Total current liabilities", {"Accounts payable": 1, "Short-term debt": 1}),
        ("Total liabilities", {"Total current liabilities": 1, "Long-term debt": 1}),
        ("Shareholders' equity", {"Total assets": 1, "Total liabilities": -1})],
    "Reconciliation of non-GAAP": [("Adjusted operating income", {"Operating income": 1, "Restructuring charges": 1})],
}


def violations(prompt):
    """(table title, row or column, found - expected) of every relation that does not hold."""
    out = []
    for title, (header, rows) in tables(prompt).items():
        for kind, relations in RELATIONS.items():
            if kind in title:
                for row, parts in relations:
                    for col, value in enumerate(rows[row]):
                        expected = sum(sign * rows[p][col] for p, sign in parts.items())
                        out += [(title, f"{row} {header[col + 1]}", value - expected)] if value != expected else []
        if "Revenue by segment" in title:
            for col in range(len(header) - 1):
                diff = rows["Total"][col] - sum(v[col] for k, v in rows.items() if k != "Total")
                out += [(title, f"Total {header[col + 1]}", diff)] if diff else []
        if "Quarterly revenue" in title:
            out += [(title, label, v[4] - sum(v[:4])) for label, v in rows.items() if v[4] != sum(v[:4])]
    return out


def table_of(tasks_tables, question, kind):
    """The (header, rows) of the `kind` table of the company the question names."""
    found = [t for title, t in tasks_tables.items()
             if kind in title and title.split(" — ")[0].split(" (")[0] in question]
    assert len(found) == 1, (question, kind)
    return found[0]


@pytest.fixture(scope="module")
def doc_tasks():
    return generate("doc_analysis", TASKS, 8192)


def test_tables_add_up_except_the_planted_inconsistency(doc_tasks):
    for t in doc_tasks:
        found = violations(t["prompt"])
        if t["type"] != "consistency":
            assert found == [], (t["id"], found)
            continue
        assert len(found) == 1, (t["id"], found)
        _, where, diff = found[0]
        assert t["answer"] in (str(abs(diff)), where), (t["id"], found)


def test_extraction_answers_are_the_named_cell(doc_tasks):
    for t in (t for t in doc_tasks if t["type"] == "extraction"):
        item, year = t["keys"]
        kind = "balance sheet" if "balance sheet" in t["question"] or item in documents.BALANCE else "income"
        header, rows = table_of(tables(t["prompt"]), t["question"], kind)
        value = rows[item][header.index(year) - 1]
        assert t["answer"] == str(value * (1000 if "thousands" in t["question"] else 1)), t["id"]


def test_cross_chapter_answers_are_the_gap_between_prose_and_table(doc_tasks):
    for t in (t for t in doc_tasks if t["type"] == "cross_chapter"):
        item, year = t["keys"]
        header, rows = table_of(tables(t["prompt"]), t["question"], "income")
        value, gap = rows[item][header.index(year) - 1], int(t["answer"])
        prose = [b for b in t["prompt"].split("\n\n") if b.split("\n")[0].endswith(f", fiscal {year}")
                 and b.split(" — ")[0][4:] in t["question"]]
        assert len(prose) == 1 and gap > 0, t["id"]
        stated = {int(n.replace(",", "")) for n in re.findall(r"\$([\d,]+) million", prose[0])}
        assert (value + gap in stated) != (value - gap in stated), t["id"]


def test_aggregation_and_comparison_answers_follow_from_the_tables(doc_tasks):
    for t in (t for t in doc_tasks if t["type"] in ("aggregation", "comparison")):
        item, year = t["keys"]
        named = {title: rows for title, (header, rows) in tables(t["prompt"]).items()
                 if "income" in title and (title.split(" — ")[0].split(" (")[0] in t["question"]
                                           or re.search(r"\((\w+)\)", title).group(1) in t["question"])}
        values = [(title, v) for title, rows in named.items() for v in rows[item]]
        if t["type"] == "comparison":
            column = {title: tables(t["prompt"])[title][1][item][tables(t["prompt"])[title][0].index(year) - 1]
                      for title in named}
            assert len(column) == 2 and max(column, key=column.get).startswith(t["answer"] + " ("), t["id"]
            continue
        combos = {a + b for (_, a) in values for (_, b) in values} | {b - a for (_, a) in values for (_, b) in values}
        assert int(t["answer"]) in combos, t["id"]
