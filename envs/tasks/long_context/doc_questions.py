"""The question types of DocAnalysis-v0 over a `documents.World`, and `make_task`.

Each builder returns the evidence sections (placed at the depth), the distractor sections (placed at random), the
question (several phrasings per type), the exact answer and the near-identical distractors it planted: other years,
other companies (one differing in a single word of its name), other units, neighbouring line items.
"""
from __future__ import annotations

import random
import re

from envs.tasks.long_context import documents, lengths

FAMILY = "doc_analysis"
TYPES = ("extraction", "cross_chapter", "consistency", "aggregation", "comparison")
HEAD = ("The document below collects excerpts from the annual reports of several companies. Each section's title "
        "names its company and its unit; figures are in millions of dollars unless a title says otherwise. Answer "
        "the question at the end.")
NUMBER_FORMAT = "Write the number in digits, without a unit or currency sign."
LOOKALIKE = {"Total assets": "Total current assets", "Total current assets": "Total assets",
             "Total liabilities": "Total current liabilities", "Total current liabilities": "Total liabilities",
             "Long-term debt": "Short-term debt", "Short-term debt": "Long-term debt", "Revenue": "Cost of revenue",
             "Cost of revenue": "Revenue", "Net income": "Income before income taxes",
             "Income before income taxes": "Net income", "Operating income": "Adjusted operating income"}
EXTRACTION = ("What was {c}'s {i} in fiscal {y}, in {u} of dollars?",
              "According to {c}'s {s}, how much was {i} for {y}? Give the amount in {u} of dollars.",
              "Look up the {I} line for fiscal {y} in the {s} of {c}. What amount does it show, in {u} of dollars?",
              "{c}, fiscal {y}: what figure was reported for {i}? Answer in {u} of dollars.")
CROSS = (("{c}'s {s} for fiscal {y} states its {i}. By how much does that figure differ from the {I} line of its "
         "consolidated statement of income for {y}? Answer in millions of dollars, as a positive number."),
         ("The {i} that {c} gives for {y} in its {s} does not match its income statement. What is the absolute "
         "difference, in millions of dollars?"),
         ("Compare the {i} for fiscal {y} in {c}'s {s} with the figure in its consolidated statement of income: how "
         "many millions of dollars apart are they?"))
WHICH_SEGMENT = (("In {c}'s quarterly revenue table for fiscal {y}, the four quarters of one segment do not add up to "
                 "its full-year figure. Which segment is it?"),
                 ("One row of the fiscal {y} quarterly revenue by segment table of {c} is inconsistent: its quarters "
                 "do not sum to the full year. Name that segment."),
                 ("Check {c}'s quarterly revenue by segment for {y}: which segment's quarterly figures fail to add up "
                 "to its full-year revenue?"))
QUARTER_GAP = (("In {c}'s quarterly revenue table for fiscal {y}, one segment's quarters do not add up to its "
               "full-year figure. By how much do they differ, in millions of dollars?"),
               ("{c} reports quarterly revenue by segment for fiscal {y}. For the segment whose quarters do not sum "
               "to its full-year revenue, how large is the gap, in millions of dollars?"))
TOTAL_GAP = (("In {c}'s revenue by segment table, the segment figures for fiscal {y} do not add up to the total "
             "shown. By how much do they differ, in millions of dollars?"),
             ("Add up {c}'s segment revenues for {y} as shown in its revenue by segment table. How far, in millions "
             "of dollars, is the sum from the reported total?"))
AGGREGATION = {
    "sum_years": ("What was {c}'s combined {i} for fiscal {y1} and fiscal {y2}, in millions of dollars?",
                  "Add {c}'s {i} of {y1} to its {i} of {y2}: what total do you get, in millions of dollars?"),
    "change_years": (("By how much did {c}'s {i} change from fiscal {y1} to fiscal {y2}? Give the signed change in "
                     "millions of dollars (negative for a decrease)."),
                     "What is {c}'s {i} for {y2} minus its {i} for {y1}, in millions of dollars?"),
    "sum_companies": ("What was the total {i} of {c} and {e} together in fiscal {y1}, in millions of dollars?",
                      "Taken together, how much {i} did {c} and {e} report for {y1}? Answer in millions of dollars."),
    "gap_companies": ("How much larger was {c}'s {i} than {e}'s in fiscal {y1}? Answer in millions of dollars.",
                      "In {y1}, by how many millions of dollars did {c}'s {i} exceed that of {e}?"),
}
COMPARISON = (("Which company reported the larger {i} for fiscal {y}: the one listed under ticker {t1} or the one "
              "listed under ticker {t2}? Answer with the company's full name."),
              ("Of the companies with tickers {t1} and {t2}, which had the higher {i} in {y}? Give its full name as "
              "written in the document."),
              "Between ticker {t1} and ticker {t2}, whose {i} was greater in fiscal {y}? Name the company.")
AGGREGATE_ITEMS = ("Revenue", "Gross profit", "Operating income", "Net income", "Research and development",
                   "Cost of revenue", "Income tax expense")


def _lower(item: str) -> str:
    return item[0].lower() + item[1:]


def _distractor(kind: str, label: str, value: int | str) -> dict:
    return {"kind": kind, "label": label, "value": documents.money(value) if isinstance(value, int) else value}


def _near_items(item: str, items: tuple[str, ...]) -> list[str]:
    """The rows next to `item` in its table, and its look-alike when that row is in the same table."""
    i = items.index(item)
    near = [items[j] for j in (i - 1, i + 1) if 0 <= j < len(items)]
    return near + [LOOKALIKE[item]] if LOOKALIKE.get(item) in items and LOOKALIKE[item] not in near else near


def extraction(world: documents.World, rng: random.Random) -> dict:
    """A table cell named by company, line item and year, in millions or (a quarter of tasks) in thousands."""
    c = world.company()
    d = world.company(world.near_name(c.name))
    balance = rng.random() < 0.3
    items, years, render = ((documents.BALANCE, c.years[:2], documents.balance_table) if balance
                            else (documents.INCOME, c.years[:3], documents.income_table))
    thousands = rng.random() < 0.25
    item = rng.choice([i for i in items if i in documents.THOUSANDS] if thousands else items)
    year = rng.choice(c.years[:2] if thousands else years)
    value = c.figures[year][item]
    scale = 1000 if thousands else 1
    dist = [_distractor("other_year", f"{item} {y}", c.figures[y][item]) for y in years if y != year]
    dist += [_distractor("near_item", f"{n} {year}", c.figures[year][n]) for n in _near_items(item, items)]
    dist.append(_distractor("other_company", f"{d.name} {item} {year}", d.figures[year][item]))
    optional = [[documents.thousands_table(c)]]
    optional += [[documents.non_gaap_table(c)]] if item == "Operating income" else []
    if item in documents.THOUSANDS and year in c.years[:2]:
        dist.append(_distractor("other_unit", f"{item} {year} in {'millions' if thousands else 'thousands'}",
                                value if thousands else 1000 * value))
    question = rng.choice(EXTRACTION).format(
        c=c.name, i=_lower(item), I=item, y=year, u="thousands" if thousands else "millions",
        s="balance sheet" if balance else "consolidated statement of income")
    return {"evidence": [render(c)], "scatter": [[render(d)]], "optional": optional, "question": question,
            "answer": str(scale * value), "numeric": True, "distractors": dist, "keys": [item, str(year)]}


def cross_chapter(world: documents.World, rng: random.Random) -> dict:
    """A figure stated in a letter or MD&A that differs from the income statement: by how much."""
    c = world.company()
    d = world.company(world.near_name(c.name))
    item, year, source = rng.choice(documents.PROSE_ITEMS), rng.choice(c.years[:2]), rng.choice(documents.SOURCES)
    true = c.figures[year][item]
    gap = rng.randint(max(5, true // 100), max(9, true // 12))
    stated = true + gap * (1 if gap >= true else rng.choice((-1, 1)))
    dist = [_distractor("stated", f"{source} {item} {year}", stated), _distractor("table", f"{item} {year}", true)]
    dist += [_distractor("other_year", f"{item} {y}", c.figures[y][item]) for y in c.years[:3] if y != year]
    dist.append(_distractor("other_company", f"{d.name} {item} {year}", d.figures[year][item]))
    question = rng.choice(CROSS).format(c=c.name, s=_lower(source), y=year, i=_lower(item), I=item)
    return {"evidence": [documents.prose_section(c, year, rng, source, {item: stated}), documents.income_table(c)],
            "spread": 0.15, "scatter": [[documents.prose_section(d, year, rng, source)]], "question": question,
            "answer": str(gap), "numeric": True, "distractors": dist, "keys": [item, str(year)]}


def consistency(world: documents.World, rng: random.Random) -> dict:
    """A planted inconsistency: which segment's figures do not add up, or by how much.

    Forms: the segment whose quarters miss its full year, the size of that gap, or how far the segment figures of a
    year are from the total of the revenue-by-segment table."""
    c = world.company()
    d = world.company(world.near_name(c.name))
    form = rng.choice(("which_segment", "quarter_gap", "total_gap"))
    if form == "total_gap":
        year = rng.choice(c.years[:3])
        gap = rng.randint(max(5, c.figures[year]["Revenue"] // 400), max(9, c.figures[year]["Revenue"] // 20))
        shown = c.figures[year]["Revenue"] + gap * rng.choice((-1, 1))
        dist = [_distractor("total_shown", f"Total {year}", shown)]
        dist += [_distractor("other_segment", f"{s} {year}", c.segment_revenue[year][s]) for s in c.segments]
        dist.append(_distractor("other_company", f"{d.name} Total {year}", d.figures[year]["Revenue"]))
        return {"evidence": [documents.segment_table(c, (year, shown - c.figures[year]["Revenue"]))],
                "scatter": [[documents.segment_table(d)]], "question": rng.choice(TOTAL_GAP).format(c=c.name, y=year),
                "answer": str(gap), "numeric": True, "distractors": dist, "keys": ["Total", str(year)]}
    year, segment, quarter = rng.choice(c.years[:2]), rng.choice(c.segments), rng.randrange(4)
    q = c.quarters[year][segment][quarter]
    gap = rng.randint(max(5, q // 40), max(9, q // 8))
    delta = gap * (1 if q <= gap else rng.choice((-1, 1)))
    scatter = [[documents.quarterly_table(d, year)]]
    evidence = [documents.quarterly_table(c, year, (segment, quarter, delta))]
    if form == "which_segment":
        dist = [_distractor("other_segment", s, s) for s in dict.fromkeys(c.segments + d.segments) if s != segment]
        return {"evidence": evidence, "scatter": scatter, "optional": [[documents.segment_table(c)]], "answer": segment,
                "numeric": False, "distractors": dist,
                "question": rng.choice(WHICH_SEGMENT).format(c=c.name, y=year), "keys": ["quarterly", str(year)]}
    dist = [_distractor("full_year", f"{s} {year}", c.segment_revenue[year][s]) for s in c.segments]
    dist.append(_distractor("altered_quarter", f"{segment} Q{quarter + 1}", q + delta))
    return {"evidence": evidence, "scatter": scatter, "optional": [[documents.segment_table(c)]], "answer": str(gap),
            "numeric": True, "distractors": dist, "question": rng.choice(QUARTER_GAP).format(c=c.name, y=year),
            "keys": ["quarterly", str(year)]}


def aggregation(world: documents.World, rng: random.Random) -> dict:
    """A sum or a difference across two years of a company, or across two companies in a year."""
    c = world.company()
    d = world.company(world.near_name(c.name))
    form, item = rng.choice(tuple(AGGREGATION)), rng.choice(AGGREGATE_ITEMS)
    y1, y2 = sorted(rng.sample(c.years[:3], 2))
    v1, v2 = c.figures[y1][item], c.figures[y2][item]
    dist = [_distractor("part", f"{item} {y}", c.figures[y][item]) for y in c.years[:3]]
    dist += [_distractor("near_item", f"{n} {y1}", c.figures[y1][n]) for n in _near_items(item, documents.INCOME)]
    dist.append(_distractor("other_company", f"{d.name} {item} {y1}", d.figures[y1][item]))
    evidence, e_name, scatter = [documents.income_table(c)], "", [[documents.income_table(d)]]
    if form in ("sum_companies", "gap_companies"):
        e = world.company()
        if form == "gap_companies" and e.figures[y1][item] > v1:
            c, e = e, c
        v2, e_name = e.figures[y1][item], e.name
        evidence, scatter = [documents.income_table(c), documents.income_table(e)], []
        dist.append(_distractor("other_year", f"{e.name} {item} {y2}", e.figures[y2][item]))
    answer = {"sum_years": v1 + v2, "change_years": v2 - v1, "sum_companies": c.figures[y1][item] + v2,
              "gap_companies": c.figures[y1][item] - v2}[form]
    question = rng.choice(AGGREGATION[form]).format(c=c.name, e=e_name, i=_lower(item), y1=y1, y2=y2)
    return {"evidence": evidence, "spread": 0.1, "scatter": scatter, "question": question,
            "answer": str(answer), "numeric": True, "distractors": dist, "keys": [item, str(y1)]}


def comparison(world: documents.World, rng: random.Random) -> dict:
    """Which of two companies, named by ticker, had the larger line item in a year (the answer: a full name)."""
    c1, c2 = world.company(), world.company()
    item, year = rng.choice([(i, y) for i in documents.INCOME for y in c1.years[:3]
                             if c1.figures[y][i] != c2.figures[y][i]])
    winner, loser = (c1, c2) if c1.figures[year][item] > c2.figures[year][item] else (c2, c1)
    d = world.company(world.near_name(winner.name))
    dist = [_distractor("other_company", loser.name, loser.name), _distractor("near_name", d.name, d.name)]
    dist += [_distractor("other_year", f"{c.name} {item} {y}", c.figures[y][item])
             for c in (c1, c2) for y in c1.years[:3] if y != year]
    t1, t2 = rng.sample([c1.ticker, c2.ticker], 2)
    question = rng.choice(COMPARISON).format(i=_lower(item), y=year, t1=t1, t2=t2)
    evidence = [documents.income_table(c1), documents.income_table(c2)]
    return {"evidence": evidence, "spread": 0.1, "scatter": [[documents.overview(d, rng)]], "question": question,
            "answer": winner.name, "numeric": False, "distractors": dist, "keys": [item, str(year)]}


BUILDERS = {"extraction": extraction, "cross_chapter": cross_chapter, "consistency": consistency,
            "aggregation": aggregation, "comparison": comparison}


def make_task(seed: int, *, target_tokens: int, depth: float, count_tokens: lengths.CountTokens,
              kind: str) -> dict:
    """One document-analysis task (the dict of `lengths.task_record`).

    Args:
      seed: the generator seed (`lengths.task_seed`); kind: one of TYPES.
      target_tokens, depth: the prompt's length in `count_tokens` tokens and where the evidence starts.

    Raises:
      ValueError: an unknown kind, a bad length or depth, or a target too small for the evidence.
    """
    if kind not in BUILDERS:
        raise ValueError(f"doc_analysis: unknown question type {kind!r}; valid types: {', '.join(TYPES)}")
    rng = random.Random(f"{FAMILY}:{kind}:{seed}")
    world = documents.World(rng)
    parts = BUILDERS[kind](world, rng)
    parts["question"] = re.sub(r"(?<=s)'s\b", "'", parts["question"])  # "Industries'", not "Industries's"
    fmt = NUMBER_FORMAT + " " if parts["numeric"] else ""
    tail = f"Question: {parts['question']}\n{fmt}{lengths.ANSWER_FORMAT}"
    blocks, lines = world.filler()
    layout = lengths.build_layout(HEAD, tail, parts["evidence"], blocks, lines, count_tokens, target_tokens, depth,
                                  rng, parts["scatter"], parts.get("spread", 0.0), parts.get("optional", ()))
    distractors = [d for d in parts["distractors"]
                   if d["value"].replace(",", "") != parts["answer"] and d["value"] in layout.prompt]
    return lengths.task_record(FAMILY, kind, seed, layout, parts["question"], parts["answer"],
                               numeric=parts["numeric"], target_tokens=target_tokens, depth=depth,
                               distractors=distractors, keys=parts["keys"])
