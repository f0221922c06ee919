"""Length and depth control shared by the long-context families: token counters, seeds per split and the layout.

A prompt is a head, a document of pieces joined by blank lines, and a tail (the question). `build_layout` draws
filler pieces until the prompt holds `target_tokens`, counting each piece once (never the whole document), and
puts the evidence where `depth` says. The approximate counter is one token per 4 characters.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import pathlib
import random
from collections.abc import Callable, Sequence

from envs.verify import answers, named

CountTokens = Callable[[str], int]
Piece = tuple[str, str]  # (text, kind): kinds are counted apart when sampled ("prose", "table", ...)
APPROX_CHARS_PER_TOKEN = 4
MIN_TARGET_TOKENS, MAX_TARGET_TOKENS = 1000, 1 << 20
SEP = "\n\n"
EXACT_TOKENS = 1 << 16  # filler is counted exactly up to this many tokens, then SAMPLE_EVERY-th piece of a kind
SAMPLE_EVERY = 8
TEST_SEED_BASE = 1 << 40  # test task i has seed TEST_SEED_BASE + i; train seeds lie below it
MAX_MISSES = 8  # top-up lines that did not fit before the filling stops
OPTIONAL_SHARE = 0.85  # optional distractor groups are kept while the fixed parts stay within this share of the target
SPLITS = ("train", "test")


def approx_tokens(text: str) -> int:
    """One token per `APPROX_CHARS_PER_TOKEN` characters, rounded up: the counter of ``tokenizer=""``."""
    return -(-len(text) // APPROX_CHARS_PER_TOKEN)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def token_counter(tokenizer: str = "") -> CountTokens:
    """The token counter of an env's ``tokenizer`` kwarg: "" -> `approx_tokens`, else a HF ``tokenizer.json`` path.

    Raises:
      FileNotFoundError: `tokenizer` names no file.
      TypeError: `tokenizer` is not a str.
    """
    if not isinstance(tokenizer, str):
        raise TypeError(f"tokenizer must be '' or a path to tokenizer.json, got {type(tokenizer).__name__}")
    if not tokenizer:
        return approx_tokens
    path = pathlib.Path(tokenizer)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer!r}: no such tokenizer.json file")
    backend = _hf_tokenizer(str(path.resolve()))
    return lambda text: len(backend.encode(text, add_special_tokens=False).ids)


def check_length(target_tokens: int, depth: float | None) -> None:
    """Raise ValueError unless `target_tokens` is an int in [MIN, MAX]_TARGET_TOKENS and `depth` None or in [0, 1]."""
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or not (
            MIN_TARGET_TOKENS <= target_tokens <= MAX_TARGET_TOKENS):
        raise ValueError(f"target_tokens must be an int in [{MIN_TARGET_TOKENS}, {MAX_TARGET_TOKENS}], "
                         f"got {target_tokens!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1):
        raise ValueError(f"depth must be None (drawn per task) or a number in [0, 1], got {depth!r}")


def task_seed(split: str, index: int, seed: int) -> int:
    """The generator seed of task `index` of `split`.

    Test seeds are TEST_SEED_BASE + index whatever `seed`; train seeds are a keyed hash of (seed, index) below
    TEST_SEED_BASE, so the splits never share a seed. Raises ValueError for a split other than "train" / "test"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "test":
        return TEST_SEED_BASE + index
    return random.Random(f"train:{seed}:{index}").randrange(TEST_SEED_BASE)


class PieceCounter:
    """Counts the tokens of filler pieces, exactly at first and by sampling past `exact_tokens`.

    Past `exact_tokens`, every `sample_every`-th piece of a kind is counted exactly and the others by that kind's
    measured tokens per character (deterministic; within a fraction of a percent on long generated text)."""

    def __init__(self, count_tokens: CountTokens, exact_tokens: int = EXACT_TOKENS,
                 sample_every: int = SAMPLE_EVERY) -> None:
        self.count_tokens, self.exact_tokens, self.sample_every = count_tokens, exact_tokens, sample_every
        self.total = 0
        self._stats: dict[str, list[int]] = {}  # kind -> [tokens counted, chars counted, pieces seen]

    def __call__(self, text: str, kind: str = "text") -> int:
        stats = self._stats.setdefault(kind, [0, 0, 0])
        if self.total < self.exact_tokens or stats[2] % self.sample_every == 0 or not stats[1]:
            n = self.count_tokens(text)
            stats[0] += n
            stats[1] += len(text)
        else:
            n = max(1, round(len(text) * stats[0] / stats[1]))
        stats[2] += 1
        self.total += n
        return n


@dataclasses.dataclass(frozen=True)
class Layout:
    """A prompt and where its parts are.

    Attributes:
      prompt: head + SEP + document + SEP + tail.
      document: (start, end) character span of the document in `prompt`.
      evidence: (start, end) character spans of the evidence pieces in `prompt`, in order.
      tokens: the prompt's counted tokens (pieces counted apart, filler past EXACT_TOKENS sampled).
      document_tokens: the document's counted tokens; depth_tokens: those before the first evidence piece.
    """

    prompt: str
    document: tuple[int, int]
    evidence: tuple[tuple[int, int], ...]
    tokens: int
    document_tokens: int
    depth_tokens: int


def _fill(budget: int, blocks: Callable[[], Piece], lines: Callable[[], Piece], counter: PieceCounter,
          rng: random.Random) -> list[tuple[str, int]]:
    """Filler pieces (text, tokens) of at most `budget` tokens: blocks while they fit, then top-up lines."""
    filler, used = [], 0
    while True:
        text, kind = blocks()
        n = counter(SEP + text, kind)
        if used + n > budget:
            break
        filler.append((text, n))
        used += n
    misses = 0
    while misses < MAX_MISSES:
        text, kind = lines()
        n = counter(SEP + text, kind)
        if used + n > budget:
            misses += 1
            continue
        filler.insert(rng.randrange(len(filler) + 1), (text, n))
        used += n
    return filler


def _scatter(filler: list, groups: Sequence[Sequence[tuple[str, int]]], rng: random.Random) -> None:
    """Insert each group's pieces at random places of `filler`, keeping each group's order."""
    for group in groups:
        places = sorted(rng.randrange(len(filler) + 1) for _ in group)
        for offset, (place, piece) in enumerate(zip(places, group)):
            filler.insert(place + offset, piece)


def build_layout(head: str, tail: str, evidence: Sequence[str], blocks: Callable[[], Piece],
                 lines: Callable[[], Piece], count_tokens: CountTokens, target_tokens: int, depth: float,
                 rng: random.Random, scatter: Sequence[Sequence[str]] = (), spread: float = 0.0,
                 optional: Sequence[Sequence[str]] = ()) -> Layout:
    """The prompt of `target_tokens` tokens with the evidence at `depth` of the document.

    Args:
      head, tail: the text before and after the document (instructions; the question).
      evidence: pieces placed in order; the first starts at `depth` of the document's tokens (or as late as the
        evidence still fits), piece i of k at depth + (1 - depth) * spread * i / (k - 1) (spread 0: contiguous).
      blocks, lines: draw the next filler piece (text, kind); `lines` gives short ones to top the length up.
      count_tokens: the tokenizer's counter; head, tail, evidence and `scatter` are counted exactly.
      scatter: groups of pieces (distractors) put at random places of the filler, each group in order.
      optional: more such groups, each kept only while the fixed parts stay within OPTIONAL_SHARE of the target.

    Returns:
      The `Layout`; its `tokens` are within a top-up line's length of `target_tokens`.

    Raises:
      ValueError: a bad length or depth, or `target_tokens` below what the head, tail, evidence and scatter need.
    """
    check_length(target_tokens, depth)
    head_n, tail_n = count_tokens(head), count_tokens(SEP + tail)
    pieces = [[(p, count_tokens(SEP + p)) for p in group] for group in scatter]
    ev = [(p, count_tokens(SEP + p)) for p in evidence]
    fixed = head_n + tail_n + sum(n for _, n in ev) + sum(n for group in pieces for _, n in group)
    if fixed > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is below the {fixed} tokens this task's question, evidence "
                         "and distractors need")
    for group in optional:
        counted = [(p, count_tokens(SEP + p)) for p in group]
        if fixed + sum(n for _, n in counted) <= OPTIONAL_SHARE * target_tokens:
            pieces.append(counted)
            fixed += sum(n for _, n in counted)
    filler = _fill(target_tokens - fixed, blocks, lines, PieceCounter(count_tokens), rng)
    _scatter(filler, pieces, rng)
    cumulative = [0]
    for _, n in filler:
        cumulative.append(cumulative[-1] + n)
    total_filler, k = cumulative[-1], len(ev)
    doc_tokens = total_filler + sum(n for _, n in ev)
    places: list[int] = []
    before = 0  # evidence tokens placed so far
    for i in range(k):
        fraction = depth + (1 - depth) * spread * (i / (k - 1) if k > 1 else 0.0)
        want = min(fraction * doc_tokens - before, total_filler)
        j = bisect.bisect_left(cumulative, want)
        j = j - 1 if j > 0 and (j == len(cumulative) or want - cumulative[j - 1] < cumulative[j] - want) else j
        places.append(max(j, places[-1] if places else 0))
        before += ev[i][1]
    return _assemble(head, tail, filler, ev, places, head_n + tail_n, cumulative)


def _assemble(head: str, tail: str, filler: list[tuple[str, int]], ev: list[tuple[str, int]], places: list[int],
              outer_tokens: int, cumulative: list[int]) -> Layout:
    """Join head, filler with the evidence inserted before filler index `places[i]`, and tail; record the spans."""
    parts, spans, offset = [head], [], len(head)
    doc_start = offset + len(SEP)
    ev_i = 0
    for j in range(len(filler) + 1):
        while ev_i < len(ev) and places[ev_i] == j:
            start = offset + len(SEP)
            parts.append(ev[ev_i][0])
            offset = start + len(ev[ev_i][0])
            spans.append((start, offset))
            ev_i += 1
        if j < len(filler):
            parts.append(filler[j][0])
            offset += len(SEP) + len(filler[j][0])
    doc_end = offset
    parts.append(tail)
    document_tokens = cumulative[-1] + sum(n for _, n in ev)
    return Layout(SEP.join(parts), (doc_start, doc_end), tuple(spans), outer_tokens + document_tokens,
                  document_tokens, cumulative[places[0]] if places else 0)


NUMERIC = {"name": "numeric", "tolerance": 0.0, "rel_tolerance": 0.0}  # exact value; "1,234" reads 1234
EXACT = {"name": "exact", "case_sensitive": False, "extract": "answer_tag"}
ANSWER_FORMAT = "Put only the final answer between <answer> and </answer>."


def task_record(family: str, kind: str, seed: int, layout: Layout, question: str, answer: str, *,
                numeric: bool, target_tokens: int, depth: float, distractors: Sequence[dict],
                keys: Sequence[str], accepted: Sequence[str] = ()) -> dict:
    """The task dict every family returns (its keys: docs/long_context.md).

    Args:
      numeric: scored by the `numeric` verifier (tolerance 0), else by `exact` (case-insensitive).
      distractors: {"kind", "label", "value"} of near-identical figures or names; keys: the question's search terms.
      accepted: other spellings `exact` accepts ("A,B" besides "A, B").
    """
    return {"id": f"{family}-{kind}-{seed}", "family": family, "type": kind, "seed": seed,
            "prompt": layout.prompt, "question": question, "answer": answer,
            "accepted": [answer, *accepted], "verifier": dict(NUMERIC if numeric else EXACT),
            "target_tokens": target_tokens, "depth": depth, "num_tokens": layout.tokens,
            "document": list(layout.document), "evidence": [list(s) for s in layout.evidence],
            "document_tokens": layout.document_tokens, "depth_tokens": layout.depth_tokens,
            "distractors": [dict(d) for d in distractors], "keys": list(keys)}


def score_reply(task: dict, reply: str) -> answers.Verdict:
    """The verdict of `reply` on `task` by its named verifier (`envs.verify.named`); never raises on the reply."""
    gold = task["accepted"] if task["verifier"]["name"] == "exact" else task["answer"]
    return named.score(task["verifier"], reply, {"answer": gold}).verdict
