"""Answer collapse: a domain whose replies give one answer far more often than its gold answers do.

Dimension legend (shape suffixes): R replies of one domain (all samples of all its tasks), T its tasks.

A policy that found a constant the scorer pays for (letter_counting: "1" to 29 of 30 held-out questions, while the
most frequent gold answer is the answer of ~0.3 of them) raises its reward without solving anything. The check
compares the modal reply share, the share of replies whose normalized answer equals the most frequent one, with
the gold answers' modal share (the same statistic over the domain's gold answers, what an honest policy's modal
share would be): a domain is **collapsed** when the modal reply share exceeds the gold share by at least `margin`
and a one-sided exact binomial test rejects at `alpha` (H0: a reply equals the modal answer with probability the
gold modal share; p = P(X >= count), X ~ Binomial(R, gold share), `upper_tail_p`: the p-value of
`scipy.stats.binomtest(..., alternative="greater")` without importing scipy.stats in every run that evaluates).
Replies without an answer are not an answer: they count in R but never form the mode. Without gold answers the
shares are reported and nothing is flagged.
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
    """The collapse check of one domain.

    Attributes:
      modal_answer: the most frequent normalized answer of the replies (None: no reply had one).
      modal_share: its count over all R replies, in [0, 1].
      gold_modal_share: the most frequent gold answer's count over the T gold answers (None without gold).
      p: the one-sided exact binomial p-value (None without gold or replies).
      collapsed: modal_share >= gold_modal_share + margin and p < alpha.
      replies: R.
    """

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
    """P(X >= count) for X ~ Binomial(n, p) (count in 1..n, p in [0, 1]): the one-sided exact binomial test's
    p-value, equal to `scipy.stats.binomtest(count, n, p, alternative="greater").pvalue` (tests check it)."""
    return float(special.bdtrc(count - 1, n, p))


def collapse_check(answers_R: Sequence[str | None], gold_T: Sequence[str | None] = (), *, alpha: float = ALPHA,
                   margin: float = MARGIN) -> Collapse:
    """The collapse check (module docstring) of one domain's reply answers against its gold answers (both
    `normalize`d here). Raises ValueError for no replies, or alpha outside (0, 1) or margin outside [0, 1]."""
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
    """The answers of one eval record's replies as its env reads them for the reasoning-gym convention
    (`envs.verify.tagged.read_answer`: the last <answer> tag after the reasoning block, else the last-line
    fallback), None where a reply has none."""
    from envs.verify import tagged

    return [tagged.read_answer(reply)[0] for reply in record.get("replies", ())]


def domain_collapse(records: Sequence[Mapping], **kwargs) -> Collapse:
    """`collapse_check` over one domain's eval records (`posttrain.eval.runner` records: replies, gold)."""
    answers = [a for r in records for a in record_answers(r)]
    return collapse_check(answers, [r.get("gold") for r in records], **kwargs)
