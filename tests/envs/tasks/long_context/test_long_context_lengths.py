"""Length and depth control of the long-context families (`envs.tasks.long_context.lengths`)."""
import itertools
import random

import pytest

from envs.tasks.long_context import lengths


def _pieces(prefix):
    counter = itertools.count()
    return lambda: (f"{prefix} piece number {next(counter)} " + "word " * 40, "prose")


def _layout(target=4000, depth=0.5, evidence=("EVIDENCE-A",), spread=0.0, scatter=()):
    return lengths.build_layout("HEAD", "TAIL?", list(evidence), _pieces("block"), lambda: ("short line.", "prose"),
                                lengths.approx_tokens, target, depth, random.Random(0), scatter, spread)


def test_approx_tokens_rounds_characters_up():
    assert [lengths.approx_tokens(s) for s in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]


def test_layout_hits_the_target_and_reports_its_parts():
    layout = _layout(target=4000)
    assert abs(lengths.approx_tokens(layout.prompt) - 4000) <= 0.01 * 4000
    assert layout.prompt.startswith("HEAD\n\n") and layout.prompt.endswith("\n\nTAIL?")
    start, end = layout.evidence[0]
    assert layout.prompt[start:end] == "EVIDENCE-A"
    doc_start, doc_end = layout.document
    assert layout.prompt[doc_start - 2:doc_start] == "\n\n" and layout.prompt[doc_end:doc_end + 2] == "\n\n"


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_evidence_starts_at_the_requested_depth(depth):
    layout = _layout(target=20000, depth=depth)
    assert abs(layout.depth_tokens / layout.document_tokens - depth) < 0.02
    doc_start, doc_end = layout.document
    fraction = (layout.evidence[0][0] - doc_start) / (doc_end - doc_start)
    assert abs(fraction - depth) < 0.02


def test_spread_evidence_keeps_its_order_and_scatter_groups_keep_theirs():
    layout = _layout(target=20000, depth=0.2, evidence=("EV-0", "EV-1", "EV-2"), spread=0.5,
                     scatter=[["SC-0", "SC-1", "SC-2"]])
    starts = [s for s, _ in layout.evidence]
    assert starts == sorted(starts) and [layout.prompt[s:e] for s, e in layout.evidence] == ["EV-0", "EV-1", "EV-2"]
    doc_start, doc_end = layout.document
    assert (starts[-1] - doc_start) / (doc_end - doc_start) == pytest.approx(0.6, abs=0.03)
    positions = [layout.prompt.index(f"SC-{i}") for i in range(3)]
    assert positions == sorted(positions)


def test_too_small_a_target_and_bad_arguments_raise():
    with pytest.raises(ValueError, match="below the"):
        _layout(target=1000, evidence=("x" * 8000,))
    for target, depth in ((999, 0.5), (lengths.MAX_TARGET_TOKENS + 1, 0.5), (2000, 1.5), (2000, -0.1), (2000.0, 0.5)):
        with pytest.raises(ValueError):
            lengths.check_length(target, depth)


def test_task_seeds_are_disjoint_between_splits_and_keyed_by_seed():
    train = {lengths.task_seed("train", i, 0) for i in range(2000)}
    test = {lengths.task_seed("test", i, 0) for i in range(2000)}
    assert not train & test and max(train) < lengths.TEST_SEED_BASE <= min(test)
    assert lengths.task_seed("test", 3, 0) == lengths.task_seed("test", 3, 9)
    assert lengths.task_seed("train", 3, 0) != lengths.task_seed("train", 3, 9)
    with pytest.raises(ValueError, match="split"):
        lengths.task_seed("validation", 0, 0)


def test_piece_counter_counts_exactly_then_samples():
    calls = []

    def count(text):
        calls.append(text)
        return len(text.split())

    counter = lengths.PieceCounter(count, exact_tokens=10, sample_every=4)
    got = [counter("a b c d e") for _ in range(20)]
    assert got == [5] * 20  # the measured ratio of the kind predicts the others exactly here
    assert 2 < len(calls) < 20


def test_token_counter_of_a_missing_file_raises():
    assert lengths.token_counter("") is lengths.approx_tokens
    with pytest.raises(FileNotFoundError, match="no-such"):
        lengths.token_counter("/no-such/tokenizer.json")
    with pytest.raises(TypeError):
        lengths.token_counter(None)
