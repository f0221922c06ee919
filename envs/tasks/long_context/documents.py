"""Generated company reports for DocAnalysis-v0: companies whose figures add up, and the sections that show them.

A `Company` holds five consistent fiscal years (integers, millions of dollars); the renderers make self-describing
sections (titled with the company's name) and plant an inconsistency only when asked; `World` draws companies with
unique names and tickers and yields the filler. The question types live in `doc_questions`.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from envs.tasks.long_context import lengths

HEADS = ("Aldmere", "Borealis", "Calder", "Dunmore", "Eastwick", "Fenwick", "Glenrock", "Harrow", "Ironvale",
         "Juniper", "Kestrel", "Larkspur", "Marlow", "Northgate", "Oakridge", "Pinecrest", "Quarry Bay", "Redfern",
         "Stonebridge", "Thornbury", "Upland", "Valemont", "Westbrook", "Yarrow", "Ashcombe", "Brightwater",
         "Copperfield", "Driftwood", "Emberly", "Foxhall", "Greystone", "Highmoor", "Ivory Coast", "Kingsley",
         "Lindqvist", "Meridian", "Nordhaven", "Orwell", "Penrose", "Ravenscar", "Silverlake", "Tidewater",
         "Umbra", "Verity", "Whitcombe", "Zephyr", "Altamira", "Bellhaven", "Castellan", "Delacroix")
TRADES = ("Shipping", "Foods", "Energy", "Robotics", "Textiles", "Pharmaceuticals", "Logistics", "Minerals",
          "Semiconductors", "Aerospace", "Retail", "Chemicals", "Software", "Paper", "Instruments", "Hospitality",
          "Telecom", "Glassworks", "Brewing", "Ceramics", "Optics", "Fertilizers", "Cable", "Furniture")
FORMS = ("Holdings", "Group", "Corporation", "Industries", "Partners", "Systems", "International", "Company")
CITIES = ("Oslo", "Rotterdam", "Chicago", "Osaka", "Lyon", "Denver", "Porto", "Halifax", "Adelaide", "Gdansk",
          "Tampere", "Valencia", "Leeds", "Calgary", "Dundee", "Bergen", "Graz", "Turin", "Austin", "Bilbao")
SEGMENTS = ("Consumer", "Industrial", "Healthcare", "Cloud Services", "Marine", "Wholesale", "Licensing",
            "Aftermarket", "Logistics", "Specialty Materials", "Defense", "Agriculture", "Components", "Packaging",
            "Water Solutions", "Mobility", "Digital Media", "Precision Tools", "Renewables", "Hospitality",
            "Financial Services", "Automation", "Lighting", "Coatings", "Diagnostics", "Rail", "Security",
            "Home Products", "Outdoor", "Education", "Payments", "Semiconductor Equipment", "Animal Health",
            "Textiles", "Chemicals", "Publishing", "Infrastructure", "Sensors", "Pharmacy", "Cold Chain")
INCOME = ("Revenue", "Cost of revenue", "Gross profit", "Research and development",
          "Selling, general and administrative", "Operating income", "Interest expense",
          "Income before income taxes", "Income tax expense", "Net income")
BALANCE = ("Cash and cash equivalents", "Accounts receivable", "Inventories", "Total current assets",
           "Property, plant and equipment", "Goodwill", "Total assets", "Accounts payable", "Short-term debt",
           "Total current liabilities", "Long-term debt", "Total liabilities", "Shareholders' equity")
THOUSANDS = ("Revenue", "Operating income", "Net income", "Total assets")
PROSE_ITEMS = ("Revenue", "Operating income", "Net income")
PROSE = {  # item -> sentences stating its value for {y} (and {p}, the year before, for {prior})
    "Revenue": ("Revenue for fiscal {y} was ${v} million, against ${prior} million in {p}.",
                "In {y} we generated revenue of ${v} million, {dir} from ${prior} million a year earlier.",
                "Sales reached ${v} million in fiscal {y}; the year before they were ${prior} million."),
    "Operating income": ("Operating income came to ${v} million in {y} (fiscal {p}: ${prior} million).",
                         "We earned operating income of ${v} million in fiscal {y}, {dir} from ${prior} million.",
                         "Operating income for {y} stood at ${v} million, compared with ${prior} million in {p}."),
    "Net income": ("Net income was ${v} million for fiscal {y}, after ${prior} million in {p}.",
                   "The year {y} closed with net income of ${v} million ({p}: ${prior} million).",
                   "Net income of ${v} million in {y} was {dir} from ${prior} million in the prior year."),
}
SOURCES = ("Letter to shareholders", "Management's discussion and analysis")
OUTLOOK = ("We enter the new year with a strong order book and a disciplined cost base.",
           "Our priorities remain customer service, safety and steady investment in our plants.",
           "The board thanks our employees for their commitment through a demanding year.",
           "We continued to simplify our portfolio and to invest where our customers are growing.")
RISKS = ("Demand for our products depends on economic conditions in our main markets.",
         "We rely on a limited number of suppliers for several critical components.",
         "Changes in tax law could affect our effective tax rate and our cash flows.",
         "A failure of our information systems could disrupt operations and harm our reputation.",
         "Currency movements affect the translation of results earned outside our home market.",
         "We face litigation from time to time, and its outcome is hard to predict.",
         "Our pension obligations depend on interest rates and on the returns of plan assets.",
         "Extreme weather can interrupt production at our plants and at those of our suppliers.")
NOTES = ("Editor's note: the excerpts below are reproduced as filed.", "All amounts are in US dollars.",
         "The following pages continue the compendium of annual report excerpts.",
         "Excerpts are ordered as received from the companies.", "Section titles name the reporting company.")


@dataclasses.dataclass
class Company:
    """One company's figures, all integers in millions of dollars, consistent with each other.

    Attributes:
      name, ticker, city: who it is; segments: its 3 or 4 reporting segments.
      years: its five fiscal years, most recent first; employees: a head count.
      figures: year -> line item (INCOME, BALANCE, "Restructuring charges", "Adjusted operating income") -> value.
      segment_revenue: year -> segment -> revenue (they sum to Revenue); quarters: year -> segment -> [Q1..Q4].
    """

    name: str
    ticker: str
    city: str
    segments: list[str]
    years: list[int]
    employees: int
    figures: dict[int, dict[str, int]]
    segment_revenue: dict[int, dict[str, int]]
    quarters: dict[int, dict[str, list[int]]]


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """`parts` positive integers summing to `total` (shares drawn between 0.2 and 0.3 before normalising)."""
    weights = [rng.uniform(0.2, 0.3) for _ in range(parts)]
    values = [max(1, round(total * w / sum(weights))) for w in weights[:-1]]
    return values + [total - sum(values)]


def _statements(rng: random.Random, revenue: int) -> dict[str, int]:
    """Income statement and balance sheet of one year from its revenue (positive margins, positive equity)."""
    f = {"Revenue": revenue, "Cost of revenue": round(revenue * rng.uniform(0.42, 0.6))}
    f["Gross profit"] = revenue - f["Cost of revenue"]
    f["Research and development"] = max(1, round(revenue * rng.uniform(0.02, 0.08)))
    f["Selling, general and administrative"] = round(revenue * rng.uniform(0.08, 0.15))
    f["Operating income"] = f["Gross profit"] - f["Research and development"] - f["Selling, general and administrative"]
    f["Interest expense"] = max(1, round(revenue * rng.uniform(0.005, 0.03)))
    f["Income before income taxes"] = f["Operating income"] - f["Interest expense"]
    f["Income tax expense"] = round(f["Income before income taxes"] * rng.uniform(0.15, 0.3))
    f["Net income"] = f["Income before income taxes"] - f["Income tax expense"]
    f["Restructuring charges"] = max(1, round(revenue * rng.uniform(0.002, 0.02)))
    f["Adjusted operating income"] = f["Operating income"] + f["Restructuring charges"]
    for item, low, high in (("Cash and cash equivalents", 0.05, 0.2), ("Accounts receivable", 0.08, 0.2),
                            ("Inventories", 0.05, 0.15), ("Property, plant and equipment", 0.4, 0.9),
                            ("Goodwill", 0.0, 0.3), ("Accounts payable", 0.05, 0.12), ("Short-term debt", 0.01, 0.08),
                            ("Long-term debt", 0.1, 0.3)):
        f[item] = max(1, round(revenue * rng.uniform(low, high)))
    f["Total current assets"] = f["Cash and cash equivalents"] + f["Accounts receivable"] + f["Inventories"]
    f["Total assets"] = f["Total current assets"] + f["Property, plant and equipment"] + f["Goodwill"]
    f["Total current liabilities"] = f["Accounts payable"] + f["Short-term debt"]
    f["Total liabilities"] = f["Total current liabilities"] + f["Long-term debt"]
    f["Shareholders' equity"] = f["Total assets"] - f["Total liabilities"]
    return f


def make_company(rng: random.Random, name: str, ticker: str, base_year: int) -> Company:
    """A company with five consistent fiscal years ending in `base_year`."""
    segments = rng.sample(SEGMENTS, rng.randint(3, 4))
    level = {s: 10 ** rng.uniform(1.9, 3.9) for s in segments}
    years = [base_year - k for k in range(5)]
    figures, segment_revenue, quarters = {}, {}, {}
    for year in reversed(years):
        level = {s: v * rng.uniform(0.9, 1.16) for s, v in level.items()}
        segment_revenue[year] = {s: max(60, round(v)) for s, v in level.items()}
        quarters[year] = {s: _split(rng, v, 4) for s, v in segment_revenue[year].items()}
        figures[year] = _statements(rng, sum(segment_revenue[year].values()))
    return Company(name, ticker, rng.choice(CITIES), segments, years, rng.randint(300, 90_000), figures,
                   segment_revenue, quarters)


def money(value: int) -> str:
    """A figure as reports print it: thousands separated by commas."""
    return f"{value:,}"


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A titled markdown table (first column left-aligned, figures right-aligned)."""
    lines = [title, "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def income_table(c: Company) -> str:
    """The consolidated statement of income, three years (the title gives the ticker)."""
    years = c.years[:3]
    return table(f"### {c.name} ({c.ticker}) — Consolidated statement of income (in millions of dollars)",
                 ["Line item", *map(str, years)], [[i, *(money(c.figures[y][i]) for y in years)] for i in INCOME])


def balance_table(c: Company) -> str:
    """The consolidated balance sheet, two year ends."""
    years = c.years[:2]
    return table(f"### {c.name} — Consolidated balance sheet at fiscal year end (in millions of dollars)",
                 ["Line item", *map(str, years)], [[i, *(money(c.figures[y][i]) for y in years)] for i in BALANCE])


def thousands_table(c: Company) -> str:
    """Selected figures in thousands of dollars (the unit distractor), two years."""
    years = c.years[:2]
    return table(f"### {c.name} — Selected financial data (in thousands of dollars)", ["Item", *map(str, years)],
                 [[i, *(money(1000 * c.figures[y][i]) for y in years)] for i in THOUSANDS])


def non_gaap_table(c: Company) -> str:
    """Operating income reconciled to adjusted operating income, two years."""
    years = c.years[:2]
    items = ("Operating income", "Restructuring charges", "Adjusted operating income")
    return table(f"### {c.name} — Reconciliation of non-GAAP measures (in millions of dollars)",
                 ["Measure", *map(str, years)], [[i, *(money(c.figures[y][i]) for y in years)] for i in items])


def segment_table(c: Company, plant: tuple[int, int] | None = None) -> str:
    """Revenue by segment with its total, three years; `plant` = (year, delta) adds delta to that year's total."""
    years = c.years[:3]
    total = {y: c.figures[y]["Revenue"] + (plant[1] if plant and plant[0] == y else 0) for y in years}
    rows = [[s, *(money(c.segment_revenue[y][s]) for y in years)] for s in c.segments]
    return table(f"### {c.name} — Revenue by segment (in millions of dollars)", ["Segment", *map(str, years)],
                 rows + [["Total", *(money(total[y]) for y in years)]])


def quarterly_table(c: Company, year: int, plant: tuple[str, int, int] | None = None) -> str:
    """Quarterly revenue by segment of `year`; `plant` = (segment, quarter index, delta) alters one quarter."""
    rows = []
    for s in c.segments:
        q = list(c.quarters[year][s])
        if plant and plant[0] == s:
            q[plant[1]] += plant[2]
        rows.append([s, *map(money, q), money(c.segment_revenue[year][s])])
    return table(f"### {c.name} — Quarterly revenue by segment, fiscal {year} (in millions of dollars)",
                 ["Segment", "Q1", "Q2", "Q3", "Q4", "Full year"], rows)


def prose_section(c: Company, year: int, rng: random.Random, source: str = SOURCES[0],
                  planted: dict[str, int] | None = None) -> str:
    """A letter or MD&A stating revenue, operating income and net income of `year` and the year before.

    `planted` overrides the value stated for `year` of an item (the cross-chapter inconsistency)."""
    sentences = []
    for item in PROSE_ITEMS:
        v = (planted or {}).get(item, c.figures[year][item])
        prior = c.figures[year - 1][item]
        sentences.append(rng.choice(PROSE[item]).format(y=year, p=year - 1, v=money(v), prior=money(prior),
                                                         dir="up" if v > prior else "down"))
    sentences.append(rng.choice(OUTLOOK))
    return f"### {c.name} — {source}, fiscal {year}\n" + " ".join(sentences)


def overview(c: Company, rng: random.Random) -> str:
    """Who the company is: its ticker, city, segments and head count."""
    segs = ", ".join(c.segments[:-1]) + " and " + c.segments[-1]
    first = rng.choice((f"{c.name} (ticker: {c.ticker}) is headquartered in {c.city}.",
                        f"Listed under the ticker {c.ticker}, {c.name} is based in {c.city}.",
                        f"{c.name}, ticker {c.ticker}, has its head office in {c.city}."))
    return (f"### {c.name} — Company overview\n{first} It reports {len(c.segments)} segments: {segs}. "
            f"It employs about {money(c.employees)} people.")


def notes(c: Company, rng: random.Random) -> str:
    """Footnotes: the tax rate, restructuring charges and the reporting unit."""
    y = c.years[0]
    rate = round(100 * c.figures[y]["Income tax expense"] / c.figures[y]["Income before income taxes"], 1)
    return (f"### {c.name} — Notes to the financial statements\n(1) Amounts are in millions of dollars unless stated "
            f"otherwise. (2) The effective tax rate was {rate}% in fiscal {y}. (3) Restructuring charges of "
            f"${money(c.figures[y]['Restructuring charges'])} million were recorded in {y}. (4) The company had "
            f"{rng.randint(2, 40)} subsidiaries at year end.")


def risks(c: Company, rng: random.Random) -> str:
    """Risk factors: generic sentences."""
    return f"### {c.name} — Risk factors\n" + " ".join(rng.sample(RISKS, rng.randint(3, 5)))


class World:
    """The companies of one document: unique names and tickers, all reporting fiscal years up to `base_year`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.base_year = rng.randint(2012, 2024)
        self.names: set[str] = set()
        self.tickers: set[str] = set()

    def _ticker(self, name: str) -> str:
        letters = "".join(w[0] for w in name.split() if w[0].isupper())
        while True:
            ticker = (letters + "".join(self.rng.choices("ABCDEFGHIJKLMNOPRSTUVWXYZ", k=4)))[:4]
            if ticker not in self.tickers:
                self.tickers.add(ticker)
                return ticker
            letters = letters[:-1]

    def company(self, name: str | None = None) -> Company:
        """A new company (`name` when given and unused, else a fresh name)."""
        while name is None or name in self.names:
            name = f"{self.rng.choice(HEADS)} {self.rng.choice(TRADES)} {self.rng.choice(FORMS)}"
        self.names.add(name)
        return make_company(self.rng, name, self._ticker(name), self.base_year)

    def near_name(self, name: str) -> str:
        """An unused name differing from `name` in one word (its form, else its trade)."""
        head, trade, form = name.rsplit(" ", 2)
        options = [f"{head} {trade} {f}" for f in FORMS] + [f"{head} {t} {form}" for t in TRADES]
        return self.rng.choice([n for n in options if n not in self.names])

    def sections(self, c: Company) -> list[tuple[str, str]]:
        """A filler chapter of company `c`: its overview, then 3 to 7 other sections in random order."""
        rng, y = self.rng, self.rng.choice(c.years[:2])
        makers: list[Callable[[], tuple[str, str]]] = [
            lambda: (income_table(c), "table"), lambda: (balance_table(c), "table"),
            lambda: (segment_table(c), "table"), lambda: (quarterly_table(c, y), "table"),
            lambda: (thousands_table(c), "table"), lambda: (non_gaap_table(c), "table"),
            lambda: (prose_section(c, y, rng, rng.choice(SOURCES)), "prose"), lambda: (notes(c, rng), "prose"),
            lambda: (risks(c, rng), "prose")]
        return [(overview(c, rng), "prose")] + [make() for make in rng.sample(makers, rng.randint(3, 7))]

    def filler(self) -> tuple[Callable[[], lengths.Piece], Callable[[], lengths.Piece]]:
        """(blocks, lines): the sections of ever new companies, and one-sentence editor's notes."""
        queue: list[tuple[str, str]] = []

        def blocks() -> lengths.Piece:
            if not queue:
                queue.extend(reversed(self.sections(self.company())))
            return queue.pop()

        return blocks, lambda: (self.rng.choice(NOTES), "prose")
