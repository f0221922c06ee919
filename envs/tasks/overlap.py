"""Exact duplicates, near-duplicates and evaluation contamination among task prompts.

Texts are compared after `normalize_text`. Near-duplicates: a Jaccard of word-bigram shingles at or above a
threshold (MinHashLSH candidates, confirmed exactly) over the shingles that are not a template's boilerplate, the
same numbers, at most `MAX_EDITS` words changed; so rows of one generator that differ in their slots (numbers,
names, word lists) are different problems. Contamination adds the 13-gram rule of GPT-3 and lm-eval-harness,
counting only n-grams of copied text, not of a template. Rules and measured rates: docs/task_checks.md. No JAX.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import itertools
import re
import unicodedata
from collections.abc import Iterable, Sequence

from datasketch import MinHash, MinHashLSH

# Word bigrams: one changed word alters at most 2 shingles, so a 15-word prompt with one word changed keeps a
# Jaccard of 12/16 = 0.75 (trigrams: 10/16).
SHINGLE_SIZE = 2
# 0.6: one changed word keeps a Jaccard of 0.75 to 0.9 for a 15- to 40-word prompt (a little less over content
# shingles where common ones are boilerplate). MAX_EDITS, MAX_EDIT_SHARE and equal numbers keep a template's
# different problems apart; the false-positive rates this gives are in docs/task_checks.md.
NEAR_THRESHOLD = 0.6
# Words inserted, deleted or replaced (on the longer side) that a near-duplicate may differ by: at most MAX_EDITS
# and at most one in 1 / MAX_EDIT_SHARE words (a prompt shorter than 10 words has no near-duplicates).
MAX_EDITS = 2
MAX_EDIT_SHARE = 0.1
# A shingle or n-gram found in more than max(BOILERPLATE_MIN_ROWS, BOILERPLATE_SHARE * rows) rows is a template's
# boilerplate (GPT-3 ignored 13-grams found in more than 10 documents, arXiv:2005.14165 appendix C).
BOILERPLATE_MIN_ROWS = 10
BOILERPLATE_SHARE = 0.01
# A shared n-gram is copied text when at least this many of its word pairs are found in no row (of either set)
# that lacks the n-gram. In a template's fixed text joined to slot values, only a rare slot value (a word of a long
# list, a large number) makes such pairs, two: with each neighbour; hence 3.
MIN_OWN_PAIRS = 3
LSH_MARGIN = 0.1  # the LSH index looks for Jaccard >= threshold - this, so few true pairs are missed
SEED = 1  # MinHash permutations; fixed so that every run reports the same pairs
DETAIL_CHARS = 80


class _PunctuationTable(dict):
    """A `str.translate` table deleting Unicode punctuation (categories P*), filled as characters are met."""

    def __missing__(self, codepoint: int) -> int | None:
        value = None if unicodedata.category(chr(codepoint)).startswith("P") else codepoint
        self[codepoint] = value
        return value


_PUNCTUATION = _PunctuationTable()
# Math signs are words of a prompt ("9 / 1" and "-9 * -1" are different problems): a sign not touching a letter is
# kept as its name, and a decimal point between digits as "point", before the rest of the punctuation goes.
_MATH_NAMES = {"-": "minus", "\u2212": "minus", "+": "plus", "*": "times", "\u00d7": "times", "/": "over",
               "\u00f7": "over", "=": "equals", "^": "pow", "%": "percent", "(": "lparen", ")": "rparen",
               "<": "less", ">": "greater"}
_MATH_RE = re.compile(r"(?<![^\W\d_])[-\u2212+*\u00d7/\u00f7=^%()<>](?![^\W\d_])|(?<=\d)\.(?=\d)")


@dataclasses.dataclass(frozen=True)
class Overlap:
    """One overlap between two rows.

    Attributes:
        a: id of the row checked (a train row, or the later of two rows).
        b: id of the other row (an eval prompt, or the earlier row).
        kind: "exact", "near_duplicate" or "ngram".
        score: exact: 1.0; near_duplicate: exact Jaccard of the content shingle sets; ngram: share of a's n-grams
            found in b.
        detail: a short human-readable excerpt (the first shared n-gram, or the words that differ).
    """

    a: str
    b: str
    kind: str
    score: float
    detail: str


def normalize_text(text: str) -> str:
    """Return ``text`` NFKC-normalized, lowercased, without punctuation (Unicode P*), whitespace collapsed.

    Math signs that touch no letter are kept as words ("9 / 1" -> "9 over 1"), and so is a decimal point.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize_text: expected str, got {type(text).__name__}")
    text = _MATH_RE.sub(lambda m: f" {_MATH_NAMES.get(m.group(), 'point')} ", unicodedata.normalize("NFKC", text))
    return " ".join(text.lower().translate(_PUNCTUATION).split())


def tokens(text: str) -> list[str]:
    """Return the words of ``normalize_text(text)``."""
    return normalize_text(text).split()


def exact_duplicates(rows: Sequence[tuple[str, str]]) -> list[Overlap]:
    """Find rows whose normalized text equals an earlier row's.

    Args:
        rows: ``(id, text)`` pairs in file order.

    Returns:
        ``Overlap(later_id, earliest_id, "exact", 1.0, excerpt)`` for each such row, in row order.

    Raises:
        TypeError: a row is not a pair of str.
    """
    rows = _checked_rows(rows, "rows")
    first: dict[str, str] = {}
    found = []
    for row_id, text in rows:
        norm = normalize_text(text)
        if norm in first:
            found.append(Overlap(row_id, first[norm], "exact", 1.0, _shorten(norm)))
        else:
            first[norm] = row_id
    return found


def near_duplicates(rows: Sequence[tuple[str, str]], *, threshold: float = NEAR_THRESHOLD,
                    num_perm: int = 128) -> list[Overlap]:
    """Find pairs of rows that are near-duplicates but not exact duplicates.

    Two rows are near-duplicates when the Jaccard similarity of their content shingles (word `SHINGLE_SIZE`-grams
    that are not boilerplate of ``rows``) is at least ``threshold``, they hold the same numbers and math symbols
    in the same order, and at most `MAX_EDITS` words (and one in 10) differ. Rows that repeat an earlier row's
    normalized text are left out (`exact_duplicates` reports them), as are rows with no content shingles.

    Args:
        rows: ``(id, text)`` pairs in file order.
        threshold: least Jaccard similarity, in (0, 1].
        num_perm: MinHash permutations; more find more pairs near the threshold, slower.

    Returns:
        ``Overlap(later_id, earlier_id, "near_duplicate", jaccard, differing words)`` per pair, in row order.

    Raises:
        TypeError: a row is not a pair of str.
        ValueError: ``threshold`` or ``num_perm`` is out of range.
    """
    rows = _checked_rows(rows, "rows")
    _check_params(threshold, num_perm)
    unique, toks = _first_occurrences(rows)
    content = _content_shingles([toks[i] for i in unique])
    lsh = _new_lsh(threshold, num_perm)
    found = []
    for k, minhash in enumerate(_minhashes(content, num_perm)):
        if minhash is None:
            continue
        for j in sorted(lsh.query(minhash)):
            overlap = _near_pair(rows, toks, unique[k], unique[j], content[k], content[j], threshold)
            if overlap is not None:
                found.append(overlap)
        lsh.insert(k, minhash, check_duplication=False)
    return found


def contamination(rows: Sequence[tuple[str, str]], reference: Sequence[tuple[str, str]], *, n: int = 13,
                  threshold: float = NEAR_THRESHOLD) -> list[Overlap]:
    """Find rows that overlap a reference set, e.g. a train file against evaluation prompts.

    A pair ``(a, b)`` is "exact" when the normalized texts are equal; "ngram" when ``a`` shares an ``n``-gram of
    tokens with ``b`` (the 13-gram rule of GPT-3 and lm-eval-harness) that is copied text rather than a template's
    (few rows hold it, `MIN_OWN_PAIRS` of its word pairs are found in no other row), or when one of them, ``n``
    tokens or longer, holds the other's whole text; "near_duplicate" as in `near_duplicates`, boilerplate counted
    over both sets. Rows shorter than ``n`` tokens are compared by the
    exact and near-duplicate rules only. Each pair is reported once, with the strongest kind.

    Args:
        rows: ``(id, text)`` pairs checked.
        reference: ``(id, text)`` pairs checked against.
        n: n-gram length in tokens.
        threshold: least Jaccard similarity of a near-duplicate, in (0, 1].

    Returns:
        Overlaps in row order, then reference order.

    Raises:
        TypeError: a row is not a pair of str.
        ValueError: ``n`` < 1 or ``threshold`` out of range.
    """
    rows = _checked_rows(rows, "rows")
    reference = _checked_rows(reference, "reference")
    _check_params(threshold, 128)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"contamination: n must be a positive int, got {n!r}")
    row_toks = [tokens(text) for _, text in rows]
    ref_toks = [tokens(text) for _, text in reference]
    by_text = collections.defaultdict(list)
    for j, t in enumerate(ref_toks):
        by_text[" ".join(t)].append(j)
    grams = _ngram_matches(row_toks, ref_toks, n)
    near = _near_matches(row_toks, ref_toks, threshold)
    found = []
    for i, t in enumerate(row_toks):
        pairs: dict[int, tuple[str, float, str]] = {}
        for j in by_text.get(" ".join(t), ()):
            pairs[j] = ("exact", 1.0, _shorten(" ".join(t)))
        for j, (score, gram) in grams.get(i, {}).items():
            pairs.setdefault(j, ("ngram", score, _shorten(gram)))
        for j, score, detail in near.get(i, ()):
            pairs.setdefault(j, ("near_duplicate", score, detail))
        found += [Overlap(rows[i][0], reference[j][0], *pairs[j]) for j in sorted(pairs)]
    return found


def _checked_rows(rows: Iterable, name: str) -> list[tuple[str, str]]:
    """Return ``rows`` as a list of ``(id, text)`` str pairs; TypeError naming the first bad row."""
    checked = []
    for k, row in enumerate(rows):
        if not (isinstance(row, (tuple, list)) and len(row) == 2 and all(isinstance(x, str) for x in row)):
            raise TypeError(f"{name}[{k}]: expected an (id, text) pair of str, got {row!r:.80}")
        checked.append((row[0], row[1]))
    return checked


def _check_params(threshold: float, num_perm: int) -> None:
    """Raise ValueError unless 0 < threshold <= 1 and num_perm is an int >= 16."""
    if not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if not isinstance(num_perm, int) or num_perm < 16:
        raise ValueError(f"num_perm must be an int >= 16, got {num_perm!r}")


def _shorten(text: str) -> str:
    """Return ``text`` cut to `DETAIL_CHARS` characters, with an ellipsis when cut."""
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


def _first_occurrences(rows: list[tuple[str, str]]) -> tuple[list[int], list[list[str]]]:
    """Return the indices of rows whose normalized text is new, and every row's tokens."""
    toks = [tokens(text) for _, text in rows]
    seen: set[str] = set()
    unique = []
    for i, t in enumerate(toks):
        key = " ".join(t)
        if key not in seen:
            seen.add(key)
            unique.append(i)
    return unique, toks


def _shingles(toks: list[str]) -> set[str]:
    """Return the word `SHINGLE_SIZE`-grams of ``toks`` (the whole text for a shorter row; none when empty)."""
    if len(toks) <= SHINGLE_SIZE:
        return {" ".join(toks)} if toks else set()
    return {" ".join(toks[i:i + SHINGLE_SIZE]) for i in range(len(toks) - SHINGLE_SIZE + 1)}


def _boilerplate_cutoff(num_rows: int) -> float:
    """Return the number of rows above which a shingle or n-gram counts as boilerplate."""
    return max(BOILERPLATE_MIN_ROWS, BOILERPLATE_SHARE * num_rows)


def _content_shingles(token_lists: list[list[str]]) -> list[set[str]]:
    """Return each row's shingles without the boilerplate ones of these (distinct) rows."""
    sets = [_shingles(t) for t in token_lists]
    counts = collections.Counter(g for s in sets for g in s)
    cutoff = _boilerplate_cutoff(len(sets))
    return [{g for g in s if counts[g] <= cutoff} for s in sets]


def _minhashes(sets: list[set[str]], num_perm: int) -> list[MinHash | None]:
    """Return a seeded MinHash per set (None for an empty set), sharing one set of permutations."""
    proto = MinHash(num_perm=num_perm, seed=SEED)
    out: list[MinHash | None] = []
    for s in sets:
        if not s:
            out.append(None)
            continue
        m = proto.copy()
        m.update_batch([g.encode("utf-8") for g in sorted(s)])
        out.append(m)
    return out


def _new_lsh(threshold: float, num_perm: int) -> MinHashLSH:
    """Return an empty MinHashLSH tuned for Jaccard >= threshold - `LSH_MARGIN`."""
    return MinHashLSH(threshold=max(0.05, threshold - LSH_MARGIN), num_perm=num_perm)


_MATH_WORDS = frozenset(_MATH_NAMES.values()) | {"point"}


def _key_tokens(toks: list[str]) -> list[str]:
    """Return the tokens of ``toks`` that hold a digit or a math symbol (Unicode Sm, or a sign `normalize_text` spelt
    out), in order."""
    return [t for t in toks if t in _MATH_WORDS or any(c.isdigit() or unicodedata.category(c) == "Sm" for c in t)]


def _edits(toks_a: list[str], toks_b: list[str]) -> int:
    """Return the words of the longer side that a longest-matching-blocks alignment leaves unmatched."""
    matcher = difflib.SequenceMatcher(None, toks_a, toks_b, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return max(len(toks_a), len(toks_b)) - matched


def _near_score(toks_a: list[str], toks_b: list[str], set_a: set[str], set_b: set[str],
                threshold: float) -> float | None:
    """Return the Jaccard of two content shingle sets when the rows are near-duplicates, else None."""
    max_edits = min(MAX_EDITS, int(MAX_EDIT_SHARE * max(len(toks_a), len(toks_b))))
    if not set_a or not set_b or abs(len(toks_a) - len(toks_b)) > max_edits:
        return None
    jaccard = len(set_a & set_b) / len(set_a | set_b)
    if jaccard < threshold or _key_tokens(toks_a) != _key_tokens(toks_b) or _edits(toks_a, toks_b) > max_edits:
        return None
    return jaccard


def _difference(toks_a: list[str], toks_b: list[str]) -> str:
    """Return a short description of the words found in only one of two token lists."""
    only_a = [t for t in dict.fromkeys(toks_a) if t not in set(toks_b)]
    only_b = [t for t in dict.fromkeys(toks_b) if t not in set(toks_a)]
    return _shorten(f"only in a: {' '.join(only_a) or '-'}; only in b: {' '.join(only_b) or '-'}")


def _near_pair(rows: list[tuple[str, str]], toks: list[list[str]], i: int, j: int, set_i: set[str],
               set_j: set[str], threshold: float) -> Overlap | None:
    """Return the near-duplicate Overlap of rows i (later) and j (earlier), or None when they are not."""
    score = _near_score(toks[i], toks[j], set_i, set_j, threshold)
    if score is None:
        return None
    return Overlap(rows[i][0], rows[j][0], "near_duplicate", score, _difference(toks[i], toks[j]))


def _near_matches(row_toks: list[list[str]], ref_toks: list[list[str]],
                  threshold: float) -> dict[int, list[tuple[int, float, str]]]:
    """Return, per row index, the ``(reference index, jaccard, detail)`` near-duplicates in the reference."""
    # Boilerplate is counted over the distinct texts of both sets, so a template shared by both is left out.
    texts = list(dict.fromkeys(" ".join(t) for t in row_toks + ref_toks))
    shingles = _content_shingles([t.split() for t in texts])
    content = dict(zip(texts, shingles))
    row_sets = [content[" ".join(t)] for t in row_toks]
    ref_sets = [content[" ".join(t)] for t in ref_toks]
    lsh = _new_lsh(threshold, 128)
    for j, minhash in enumerate(_minhashes(ref_sets, 128)):
        if minhash is not None:
            lsh.insert(j, minhash, check_duplication=False)
    near: dict[int, list[tuple[int, float, str]]] = {}
    for i, minhash in enumerate(_minhashes(row_sets, 128)):
        if minhash is None:
            continue
        for j in sorted(lsh.query(minhash)):
            if row_toks[i] == ref_toks[j]:
                continue
            score = _near_score(row_toks[i], ref_toks[j], row_sets[i], ref_sets[j], threshold)
            if score is not None:
                near.setdefault(i, []).append((j, score, _difference(row_toks[i], ref_toks[j])))
    return near


Gram = tuple[str, ...]


def _ngram_matches(row_toks: list[list[str]], ref_toks: list[list[str]],
                   n: int) -> dict[int, dict[int, tuple[float, str]]]:
    """Return, per row and reference row that overlap by n-grams, the share of the row's n-grams shared and one.

    They overlap when they share a copied n-gram (`_copied_ngrams`) or when one's text contains the other's.
    """
    index: dict[Gram, list[int]] = collections.defaultdict(list)
    for j, t in enumerate(ref_toks):
        for g in set(_ngrams(t, n)):
            index[g].append(j)
    copied = _copied_ngrams(row_toks, ref_toks, n, index)
    ref_texts = [f" {' '.join(t)} " for t in ref_toks]
    anchors: dict[Gram, list[int]] = collections.defaultdict(list)  # reference rows by their rarest n-gram
    for j, t in enumerate(ref_toks):
        if len(t) >= n:
            anchors[min(_ngrams(t, n), key=lambda g: len(index[g]))].append(j)
    found: dict[int, dict[int, tuple[float, str]]] = {}
    for i, t in enumerate(row_toks):
        grams = list(dict.fromkeys(_ngrams(t, n)))
        text = f" {' '.join(t)} "
        contained = {j for g in grams for j in anchors.get(g, ()) if ref_texts[j] in text}
        if grams:  # a row inside a reference row holds all its n-grams, the rarest included
            rarest = min(grams, key=lambda g: len(index.get(g, ())))
            contained |= {j for j in index.get(rarest, ()) if text in ref_texts[j]}
        # a copy with words added holds the same numbers; a template's slot list that grows does not ("2 grasshoppers"
        # inside "2 grasshoppers, 3 jellyfish" is another problem)
        contained = {j for j in contained if _key_tokens(t) == _key_tokens(ref_toks[j])}
        for j in sorted({j for g in grams if g in copied for j in index[g]} | contained):
            shared = [g for g in grams if f" {' '.join(g)} " in ref_texts[j]]
            first = next((g for g in shared if g in copied), shared[0])
            found.setdefault(i, {})[j] = (len(shared) / len(grams), " ".join(first))
    return found


def _copied_ngrams(row_toks: list[list[str]], ref_toks: list[list[str]], n: int,
                   index: dict[Gram, list[int]]) -> set[Gram]:
    """Return the reference n-grams, shared with a row, that are copied text rather than a template's.

    Such an n-gram is held by at most `_boilerplate_cutoff` rows of both sets, and at least `MIN_OWN_PAIRS` of its
    word pairs are found in no row that lacks it.
    """
    held = collections.Counter({g: len(js) for g, js in index.items()})
    for t in row_toks:
        held.update(g for g in set(_ngrams(t, n)) if g in index)
    cutoff = _boilerplate_cutoff(len(row_toks) + len(ref_toks))
    shared = [g for g, js in index.items() if len(js) < held[g] <= cutoff]
    word_pairs = {p for g in shared for p in itertools.pairwise(g)}
    pair_rows = collections.Counter(p for t in row_toks + ref_toks for p in set(itertools.pairwise(t)) if p in word_pairs)
    return {g for g in shared if sum(pair_rows[p] <= held[g] for p in set(itertools.pairwise(g))) >= MIN_OWN_PAIRS}


def _ngrams(toks: list[str], n: int) -> list[Gram]:
    """Return the word n-grams of ``toks`` in order (none for a row shorter than n)."""
    return [tuple(toks[k:k + n]) for k in range(len(toks) - n + 1)]
