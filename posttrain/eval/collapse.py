"""Answer collapse: a domain whose replies give one answer far more often than its gold answers do.

Shapes: the legend in `posttrain.types`. The test (exact binomial, against the gold modal share): docs/evaluation.md.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from scipy import special

ALPHA = 0.01
MARGIN = 0.2  # share points the modal reply share must exceed the gold modal share by


@dataclasses.dataclass(frozen=True)
class Collapse:
    """The collapse check of one domain (gold_modal_share and p are None without gold answers)."""

    modal_answer: str | None
    modal_share: float
    gold_modal_share: float | None
    p: float | None
    collapsed: bool
    replies: int


def normalize(answer: str | None) -> str | None:
    """An answer compared for collapse: whitespace runs joined by one space, stripped, lower-cased; "" -> None."""
    if answer is None:
        return None
    text = " ".join(str(answer).split()).lower()
    return text or None


def modal(values: Sequence[str | None]) -> tuple[str | None, int]:
    """(the most frequent non-None value, its count); ties go to the value seen first; (None, 0) for none."""
    counts = collections.Counter(v for v in values if v is not None)
    if not counts:
        return None, 0
    best = max(counts.values())
    return next(v for v in values if v is not None and counts[v] == best), best


def upper_tail_p(count: int, n: int, p: float) -> float:
    """P(X >= count), X ~ Binomial(n, p): the one-sided exact binomial p-value (scipy's `binomtest` "greater")."""
    return float(special.bdtrc(count - 1, n, p))


def collapse_check(answers_R: Sequence[str | None], gold_T: Sequence[str | None] = (), *, alpha: float = ALPHA,
                   margin: float = MARGIN) -> Collapse:
    """The `Collapse` of one domain's reply answers against its gold answers; ValueError for none or bad settings."""
    if not 0.0 < alpha < 1.0 or not 0.0 <= margin <= 1.0:
        raise ValueError(f"collapse_check needs 0 < alpha < 1 and 0 <= margin <= 1, got alpha={alpha}, margin={margin}")
    answers = [normalize(a) for a in answers_R]
    if not answers:
        raise ValueError("collapse_check of a domain with no replies")
    answer, count = modal(answers)
    share = count / len(answers)
    golds = [g for g in (normalize(g) for g in gold_T) if g is not None]
    if not golds:
        return Collapse(answer, share, None, None, False, len(answers))
    gold_share = modal(golds)[1] / len(golds)
    p = upper_tail_p(count, len(answers), gold_share) if count else 1.0
    return Collapse(answer, share, gold_share, p, bool(share >= gold_share + margin and p < alpha), len(answers))


def record_answers(record: Mapping) -> list[str | None]:
    """The answers of one eval record's replies by `envs.verify.tagged.read_answer` (None where a reply has none)."""
    from envs.verify import tagged

    return [tagged.read_answer(reply)[0] for reply in record.get("replies", ())]


def domain_collapse(records: Sequence[Mapping], **kwargs) -> Collapse:
    """`collapse_check` over one domain's eval records (their replies and gold answers)."""
    answers = [a for r in records for a in record_answers(r)]
    return collapse_check(answers, [r.get("gold") for r in records], **kwargs)
