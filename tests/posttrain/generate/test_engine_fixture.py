"""Issue 25 acceptance 1, the recorded fixture: the engine's greedy replies to the quickstart's 200 held-out prompts
equal transformers' (tests/golden/smollm2_greedy_200.npz, scripts/record_greedy_fixture.py: SmolLM2-135M-Instruct,
float32, 24 new tokens) on >= 199 of 200, and every reply that differs first differs at a step whose top-2 logit gap
in the peer's logits was < 1e-4 (a near tie). Default: the first `HEAD` tokens of the 8 prompts whose smallest
recorded gap (their closest call) lies among those tokens, smallest first; slow: all 200 replies in full.
"""
import functools
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from posttrain.generate.engine.loop import Engine, EngineSettings, Request

ROOT = pathlib.Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "golden" / "smollm2_greedy_200.npz"
GAP_TIE = 1e-4
HEAD = 10  # tokens of the default case's replies (a greedy reply's first tokens are the whole reply's prefix)


def _script():
    path = ROOT / "scripts" / "record_greedy_fixture.py"
    spec = importlib.util.spec_from_file_location("record_greedy_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def _fixture() -> dict:
    f = np.load(FIXTURE)
    rec = _script()
    return {"prompts": rec.unpack(f["prompt_ids"], f["prompt_offsets"]),
            "replies": rec.unpack(f["reply_ids"], f["reply_offsets"]),
            "gaps": rec.unpack(f["gap"], f["reply_offsets"]), "max_new_tokens": int(f["max_new_tokens"]),
            "stop_ids": tuple(int(s) for s in f["stop_ids"])}


def first_differences(got, want, gaps) -> list[tuple[int, int, float]]:
    """[(prompt, first differing step, the peer's top-2 gap there)] for every reply that differs from the fixture
    (a reply that stops early or runs on differs where the shorter ends; gap inf past the peer's reply)."""
    out = []
    for i, (g, w, gap) in enumerate(zip(got, want, gaps)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape == w.shape and (g == w).all():
            continue
        n = min(len(g), len(w))
        t = int(np.argmax(g[:n] != w[:n])) if (g[:n] != w[:n]).any() else n
        out.append((i, t, float(gap[t]) if t < len(gap) else float("inf")))
    return out


@pytest.mark.parametrize("got, want, bad", [
    ([[5, 6, 2]], [[5, 6, 2]], []),                       # equal
    ([[5, 7, 2]], [[5, 6, 2]], [(0, 1, 0.5)]),            # a token differs at step 1
    ([[5, 6]], [[5, 6, 2]], [(0, 2, 0.25)]),              # stops short
    ([[5, 6, 2, 9]], [[5, 6, 2]], [(0, 3, float("inf"))]),  # runs past the peer's reply
    ([[1], [5, 6, 2]], [[4], [5, 6, 2]], [(0, 0, 1.0)]),  # only the first of two differs
])
def test_first_differences(got, want, bad):
    gaps = [np.asarray([1.0, 0.5, 0.25])[:len(w)] for w in want]
    assert first_differences(got, want, gaps) == bad


@functools.lru_cache(maxsize=None)
def _engine():
    from posttrain.checkpoints import load_pretrained

    from helpers import smollm2_path

    pre = load_pretrained(smollm2_path(), dtype="float32", param_dtype="float32")  # skips without the GGUF
    settings = EngineSettings(num_slots=8, num_pages=8 * 5 + 1, page_size=16, max_seq_len=80, prefill_bucket=48)
    return pre, Engine(pre.graphdef, pre.state, settings)


def _check(indices, head: int = 0) -> tuple[int, list]:
    """(replies equal to the fixture's, first_differences) of the engine's greedy replies to prompts `indices`,
    each cut to its first `head` tokens on both sides (0: whole); asserts every difference is at a near tie."""
    fx = _fixture()
    pre, engine = _engine()
    budget = head or fx["max_new_tokens"]
    requests = [Request(prompt=tuple(int(t) for t in fx["prompts"][i]), max_new_tokens=budget,
                        temperature=0.0, stop_ids=fx["stop_ids"]) for i in indices]
    completions = engine.generate(requests, jax.random.key(0))
    diffs = first_differences([c.tokens for c in completions], [fx["replies"][i][:budget] for i in indices],
                              [fx["gaps"][i][:budget] for i in indices])
    assert all(gap < GAP_TIE for _, _, gap in diffs), f"differences at a top-2 gap >= {GAP_TIE}: {diffs}"
    return len(indices) - len(diffs), diffs


def test_greedy_equals_fixture_on_the_closest_calls():
    """The 8 prompts whose closest calls (smallest recorded top-2 gaps: the first to flip under a numerics change)
    come within their first HEAD tokens; the fixture's prompt ids are the quickstart's rendering today (it still
    asks the right questions)."""
    fx = _fixture()
    early = [i for i, g in enumerate(fx["gaps"]) if g.argmin() < HEAD]
    order = sorted(early, key=lambda i: fx["gaps"][i].min())[:8]
    assert len(order) == 8 and fx["gaps"][order[0]].min() < 1e-3  # the fixture holds close calls to test
    pre, _ = _engine()
    _, rendered = _script().quickstart_prompts(pre.tokenizer)
    assert len(rendered) == len(fx["prompts"]) == 200
    assert all(list(map(int, p)) == r for p, r in zip(fx["prompts"], rendered))
    _check(order, HEAD)


@pytest.mark.slow  # all 200: 531 s at load ~12 on the 2-core CPU (200/200 equal); the 8 closest calls run by default
def test_greedy_equals_fixture_on_all_200():
    equal, diffs = _check(list(range(200)))
    assert equal >= 199, diffs
