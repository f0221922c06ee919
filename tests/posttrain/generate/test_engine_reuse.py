"""The engine's prefix reuse and weight swaps (issue 25 items 3 and 4, acceptance 3) on tiny-dense in float32: a
4-turn episode prefills only each turn's new tokens (counted) with the logprobs of a full re-prefill (<= 1e-5);
G = 4 samples of one prompt hold its full pages once; a weight swap between decode chunks records per-token
versions, and the tokens after it equal a fresh engine's with the new weights from that state. The prefix cache's
trie, tails, eviction and version clearing are checked on the host alone.
"""
import jax
import numpy as np
import pytest

from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.kv_pages import PagePool
from posttrain.generate.prefix_cache import PrefixCache
from helpers import random_model

Z = 4


def _engine(state, graphdef, prefix_cache=True, version=0):
    """The engine size of test_engine.py (one decode compile for both files)."""
    return Engine(graphdef, state, EngineSettings(num_slots=4, num_pages=12, page_size=Z, max_seq_len=40,
                                                  prefill_bucket=32, prefix_cache=prefix_cache, drain_chunk=1),
                  version=version)


def test_four_turn_episode_prefills_only_new_tokens():
    """Turn k + 1's prompt = turn k's prompt + its reply + 3 env/template tokens. With the cache a turn prefills
    its prompt less the tokens the last turn left in pages (its prompt and reply but the reply's last token);
    without, the whole prompt. Replies and logprobs equal (<= 1e-5), turn by turn."""
    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(5)
    cached, fresh = _engine(state, graphdef), _engine(state, graphdef, prefix_cache=False)
    prompt, left = rng.integers(4, cfg.vocab_size, 6).tolist(), 0
    for turn in range(4):
        req = Request(prompt=tuple(prompt), max_new_tokens=4, temperature=0.0, stop_ids=(1, 2))
        got, want = cached.generate([req], jax.random.key(turn))[0], fresh.generate([req], jax.random.key(turn))[0]
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"turn {turn}")
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, err_msg=f"turn {turn}")
        assert cached.metrics["rollout/prefill_tokens"] == len(prompt) - left, turn
        assert cached.metrics["rollout/prefix_cached_tokens"] == left
        assert fresh.metrics["rollout/prefill_tokens"] == len(prompt)
        left = len(prompt) + len(got.tokens) - 1
        prompt = prompt + got.tokens.tolist() + rng.integers(4, cfg.vocab_size, 3).tolist()
    assert left > 6 + 3 * 3  # the episode grew past its first pages (tokens beyond the first turn reused)


def _teacher_forced(graphdef, state, prompt, replies, width=40):
    """log_softmax(logits) (T = 1) of each reply's tokens after prompt, from one full forward per row."""
    from flax import nnx
    import jax.numpy as jnp

    seq, seg = np.zeros((len(replies), width), np.int32), np.zeros((len(replies), width), np.int32)
    for i, r in enumerate(replies):
        seq[i, :len(prompt) + len(r)], seg[i, :len(prompt) + len(r)] = list(prompt) + list(r), 1
    logp = np.asarray(jax.nn.log_softmax(nnx.merge(graphdef, state)(jnp.asarray(seq), None, jnp.asarray(seg))[0]))
    return [logp[i, len(prompt) - 1 + np.arange(len(r)), r] for i, r in enumerate(replies)]


def test_a_prompt_sharing_pages_another_request_of_its_round_computes_runs_after_it():
    """One admission round: X2 (the next turn of a cached X: an extend), A (a fresh 9-token prompt: a prefill) and
    B (A's first 8 tokens, both of its full pages, then 5 others: an extend sharing pages A computes). B's extend
    has X2's program width, but must run after A's prefill: in X2's program, which ran first, it read A's pages
    before they were written (wrong logprobs from its first token; the tool config's third turns at 64 slots).
    Tokens and logprobs equal an engine without the prefix cache (<= 1e-5)."""
    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(9)
    cached, fresh = _engine(state, graphdef), _engine(state, graphdef, prefix_cache=False)

    def req(prompt):
        return Request(prompt=tuple(prompt), max_new_tokens=2, temperature=0.0, stop_ids=(1, 2))

    x = rng.integers(4, cfg.vocab_size, 6).tolist()
    reply = cached.generate([req(x)], jax.random.key(0))[0].tokens.tolist()
    a = rng.integers(4, cfg.vocab_size, 9).tolist()
    round_ = [req(x + reply + [5, 6, 7]), req(a), req(a[:8] + rng.integers(4, cfg.vocab_size, 5).tolist())]
    got, want = cached.generate(round_, jax.random.key(1)), fresh.generate(round_, jax.random.key(1))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g.tokens, w.tokens, err_msg=f"request {i}")
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, err_msg=f"request {i}")
    assert cached.metrics["rollout/prefix_cached_tokens"] == len(x) + len(reply) - 1 + 8  # X's turn, A's pages


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_group_shares_prompt_pages(monkeypatch, prefix_cache):
    """4 samples of a 10-token prompt (2 full pages + 2 tokens): the first prefills it, the only program to run
    the model before decoding (no `extend`); the others draw their first tokens from its logits and hold copies
    of its pages (with the prefix cache: its 2 full pages shared, a copy of its partial third page; without: copies
    of all 3, as many at a time as the pool holds). Every sample's logprobs equal one teacher-forced forward's (<= 1e-5: a missing or wrong page copy
    changes the logprobs after it); pages handed out with the cache: 2 + each sample's own."""
    from posttrain.generate.engine import admission

    cfg, graphdef, state = random_model("tiny-dense")
    prompt = tuple(np.random.default_rng(6).integers(4, cfg.vocab_size, 10).tolist())
    requests = [Request(prompt=prompt, max_new_tokens=6, temperature=1.0, stop_ids=(1,)) for _ in range(4)]
    calls = []
    for name in ("prefill", "extend"):
        monkeypatch.setattr(admission, name, lambda *a, _f=getattr(admission, name), _n=name, **k:
                            calls.append(_n) or _f(*a, **k))
    engine = _engine(state, graphdef, prefix_cache=prefix_cache)
    got = engine.generate(requests, jax.random.key(1))
    # without the cache the pool (11 pages) holds 2 samples' 4 pages: the others are admitted later (prefilled
    # again) or preempted and recomputed
    assert calls == ["prefill"] if prefix_cache else set(calls) == {"prefill"}
    for g, want in zip(got, _teacher_forced(graphdef, state, prompt, [g.tokens for g in got])):
        np.testing.assert_allclose(g.logprobs, want, atol=1e-5)
    assert len({tuple(g.tokens) for g in got}) > 1  # the samples differ
    assert engine.metrics["rollout/kv_pages_used"] <= engine.metrics["rollout/kv_pages_allocated"]
    if prefix_cache:
        assert engine.metrics["rollout/prefill_tokens"] == 10
        assert engine.metrics["rollout/prefix_cached_tokens"] == 3 * 10
        held = [engine._pages.pages_for(10 + max(len(g.tokens) - 1, 1)) for g in got]
        assert engine._pages.allocations == 2 + sum(h - 2 for h in held)


def test_weight_swap_mid_generation_records_versions():
    """update_weights from on_chunk after chunk 3 (5 tokens each: the prefill's and 4 decode steps'): those carry
    version 0, the rest version 7; the rest equal a fresh engine with the new weights continuing each request
    from its first 5 tokens (greedy, <= 1e-5). A second swap between calls invalidates the cache."""
    cfg, graphdef, state = random_model("tiny-dense")
    _, _, new_state = random_model("tiny-dense", seed=1)
    rng = np.random.default_rng(7)
    requests = [Request(prompt=tuple(rng.integers(4, cfg.vocab_size, n).tolist()), max_new_tokens=10,
                        temperature=0.0) for n in (5, 9)]
    engine = _engine(state, graphdef)

    def swap(eng, chunk):
        if chunk == 3:
            eng.update_weights(new_state, 7)

    got = engine.generate(requests, jax.random.key(0), on_chunk=swap)
    assert engine.version == 7 and engine.metrics["rollout/weight_swaps"] == 1
    fresh = _engine(new_state, graphdef, version=7)
    cont = fresh.generate([Request(prompt=r.prompt + tuple(g.tokens[:5].tolist()), max_new_tokens=5,
                                   temperature=0.0) for r, g in zip(requests, got)], jax.random.key(0))
    for g, c in zip(got, cont):
        assert g.versions.tolist() == [0] * 5 + [7] * 5
        np.testing.assert_array_equal(g.tokens[5:], c.tokens)
        np.testing.assert_allclose(g.logprobs[5:], c.logprobs, atol=1e-5)
        assert (c.versions == 7).all()
    assert engine.metrics["rollout/prefill_tokens"] == 5 + 9 + (5 + 4) + (9 + 4)  # recomputed at the swap
    engine.update_weights(state, 8)
    again = engine.generate(requests[:1], jax.random.key(0))[0]
    assert engine.metrics["rollout/prefix_cached_tokens"] == 0 and (again.versions == 8).all()
    with pytest.raises(ValueError, match="differs in structure, shapes or dtypes"):
        engine.update_weights(random_model("tiny-dense", d_model=32)[2], 9)


def test_prefix_cache_trie_tails_eviction_and_versions():
    pool = PagePool(num_pages=8, num_slots=2, pages_per_seq=4, page_size=Z)
    cache = pool.cache = PrefixCache(Z, pool.ref_P)
    toks = list(range(10, 24))  # 14 tokens: pages of [10..13], [14..17], [18..21], tail [22, 23]
    assert pool.grow(0, 14)
    cache.register(pool.table_SxM[0], toks, 14, tail=True)
    pool.release(0)
    assert len(cache) == 4 and pool.allocated == 0 and pool.available() == 7
    full, tail, t = cache.match(toks[:13] + [99], limit=13)  # the third page's tokens need all 4 within limit
    assert full == [1, 2, 3] and tail is None and t == 0
    full, tail, t = cache.match(toks + [5], limit=14)
    assert full == [1, 2, 3] and tail == 4 and t == 2
    assert cache.match([10, 11, 12, 99, 1], limit=5)[0] == []  # a different first page: nothing
    pool.share(1, full)
    cache.take_tail(tail)  # the engine's admission: the tail becomes the slot's own page
    pool.share(1, [tail])
    assert pool.grow(1, 16) and pool.allocations == 4 and pool.allocated == 4 and not cache.holds(4)
    assert cache.evict() is None  # every cached page is held
    pool.release(1)
    assert 4 in pool.free_pages and pool.available() == 7
    assert cache.evict() == 3 and cache.evict() == 2  # leaves first: the chain from its end
    assert cache.clear(version=1) == [1] and len(cache) == 0
    assert cache.match(toks, limit=14) == ([], None, 0)
    with pytest.raises(ValueError, match="page_size=0"):
        PrefixCache(0, pool.ref_P)


def test_per_episode_turns_queued_as_each_ends():
    """Two 3-turn episodes in one generate call: on_finish returns each episode's next turn (its prompt + reply +
    2 env tokens) as soon as its turn ends, so the short-reply episode A runs all 3 turns while B's first long
    reply decodes; every turn past the first prefills only its new tokens, and the replies equal turn-by-turn
    calls of an engine without the cache (greedy, <= 1e-5)."""
    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(8)
    first = {0: (rng.integers(4, cfg.vocab_size, 3).tolist(), 2), 1: (rng.integers(4, cfg.vocab_size, 4).tolist(), 5)}
    bridges = rng.integers(4, cfg.vocab_size, (2, 3, 2)).tolist()
    episode, prompts, events, want_prefill = {0: 0, 1: 1}, {0: first[0][0], 1: first[1][0]}, [], 7

    def req(ep):
        return Request(prompt=tuple(prompts[ep]), max_new_tokens=first[ep][1], temperature=0.0)

    def on_finish(index, completion):
        nonlocal want_prefill
        ep = episode[index]
        turn = sum(e == ep for e, _ in events)
        events.append((ep, completion))
        if turn == 2:
            return None
        left = len(prompts[ep]) + len(completion.tokens) - 1
        prompts[ep] = prompts[ep] + completion.tokens.tolist() + bridges[ep][turn]
        want_prefill += len(prompts[ep]) - left
        episode[len(episode)] = ep
        return req(ep)

    engine = _engine(state, graphdef)
    out = engine.generate([req(0), req(1)], jax.random.key(0), on_finish=on_finish)
    assert [ep for ep, _ in events] == [0, 0, 0, 1, 1, 1] and len(out) == 6
    assert engine.metrics["rollout/prefill_tokens"] == want_prefill
    plain = _engine(state, graphdef, prefix_cache=False)
    for ep in (0, 1):
        prompt = first[ep][0]
        for turn, (_, got) in enumerate(e for e in events if e[0] == ep):
            want = plain.generate([Request(prompt=tuple(prompt), max_new_tokens=first[ep][1], temperature=0.0)],
                                  jax.random.key(0))[0]
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
            prompt = prompt + got.tokens.tolist() + (bridges[ep][turn] if turn < 2 else [])



def _futures_episodes(state, graphdef, cfg, mode: str, follow_after: int, temperature: float, sleep_seed: int = 0):
    """Two 3-turn episodes; on_finish returns each next turn as a Request ("direct") or as a Future done on a
    thread after a random sleep ("future"). Returns (completions, each episode's (tokens, logprobs) turn by turn,
    each episode's turns' (first, last) decode chunks)."""
    import random
    import time
    from concurrent.futures import ThreadPoolExecutor

    rng, nap = np.random.default_rng(8), random.Random(sleep_seed)
    prompts = {0: rng.integers(4, cfg.vocab_size, 3).tolist(), 1: rng.integers(4, cfg.vocab_size, 4).tolist()}
    budget, episode, turns, live, ended = {0: 3, 1: 24}, {0: 0, 1: 1}, {0: [], 1: []}, [], {}

    def req(ep):
        return Request(prompt=tuple(prompts[ep]), max_new_tokens=budget[ep], temperature=temperature)

    def follow(ep, completion):
        if mode == "future":
            time.sleep(nap.random() * 0.03)
        if len(turns[ep]) == 3:
            return None
        prompts[ep] = prompts[ep] + completion.tokens.tolist() + [5, 6]
        return req(ep)

    with ThreadPoolExecutor(1) as pool:
        def on_finish(index, completion):
            ep, ended[index] = episode[index], engine._chunk
            turns[ep].append((completion.tokens.tolist(), completion.logprobs))
            if mode == "direct":
                nxt = follow(ep, completion)
                if nxt is not None:
                    episode[len(episode)] = ep
                return nxt
            episode[len(episode)] = ep
            return pool.submit(follow, ep, completion)

        engine = Engine(graphdef, state, EngineSettings(num_slots=4, num_pages=40, page_size=Z, max_seq_len=128,
                                                        prefill_bucket=32))
        out = engine.generate([req(0), req(1)], jax.random.key(3), follow_after=follow_after, on_finish=on_finish,
                              on_chunk=lambda e, c: live.append({q.index for q in e._slots if q is not None}))
    spans = {0: [], 1: []}
    for index in sorted(ended):  # (first chunk live after its step: budgets >= 3, no stop ids; chunk it ended)
        spans[episode[index]].append((min(c for c, ids in enumerate(live) if index in ids), ended[index]))
    return out, turns, spans


def test_follow_up_futures_keep_the_order_whatever_the_env_takes():
    """on_finish may return a Future of the next turn (its env steps on another thread): at follow_after=0 the run
    decodes as returning the Request itself does (greedy tokens, chunk by chunk); at follow_after=3 each next
    turn first decodes exactly 3 chunks after its last turn's final chunk while another episode decodes (at once
    when none does: episode 1's long turns outlast episode 0's three short ones), and two runs at T = 1 with different
    env sleeps are equal (tokens, logprobs, chunks); a Future that gives None leaves None at its index."""
    cfg, graphdef, state = random_model("tiny-dense")
    direct = _futures_episodes(state, graphdef, cfg, "direct", 0, 0.0)
    now = _futures_episodes(state, graphdef, cfg, "future", 0, 0.0)
    assert sum(c is None for c in direct[0]) == 0 and sum(c is None for c in now[0]) == 2 and len(now[0]) == 8
    assert direct[2] == now[2] and all(len(v) == 3 for v in now[2].values())
    for ep in (0, 1):
        assert [t for t, _ in direct[1][ep]] == [t for t, _ in now[1][ep]]
        assert all(b[0] == a[1] + 1 for a, b in zip(now[2][ep], now[2][ep][1:]))
    late = [_futures_episodes(state, graphdef, cfg, "future", 3, 1.0, sleep_seed=s) for s in (1, 2)]
    assert late[0][2] == late[1][2]
    for ep in (0, 1):
        a, b = late[0][1][ep], late[1][1][ep]
        assert [t for t, _ in a] == [t for t, _ in b] and len(a) == 3
        for (_, la), (_, lb) in zip(a, b):
            np.testing.assert_array_equal(la, lb)
        spans = late[0][2][ep]
        assert all(nxt[0] == prev[1] + (3 if ep == 0 else 1) for prev, nxt in zip(spans, spans[1:])), spans
    assert late[0][2][0][-1][1] < late[0][2][1][0][1]  # episode 0 ended within episode 1's first turn


def test_an_admission_extends_its_cached_prompts_in_one_program(monkeypatch):
    """Three next turns whose earlier turns are cached to different depths (and a page boundary apart) are
    admitted together (10 pages: the pool holds them): one `extend` program of 4 rows (3 and a padding row) computes their new tokens, and every
    reply's logprobs equal one teacher-forced forward's (<= 1e-5)."""
    from posttrain.generate.engine import admission

    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(11)
    firsts = [tuple(rng.integers(4, cfg.vocab_size, n).tolist()) for n in (3, 5, 7)]
    engine = _engine(state, graphdef)
    done = engine.generate([Request(prompt=p, max_new_tokens=3, temperature=0.0, stop_ids=(1,)) for p in firsts],
                           jax.random.key(0))
    nexts = [p + tuple(c.tokens.tolist()) + tuple(rng.integers(4, cfg.vocab_size, k).tolist())
             for p, c, k in zip(firsts, done, (1, 2, 1))]
    shapes = []
    monkeypatch.setattr(admission, "extend", lambda *a, _f=admission.extend, **k:
                        shapes.append((a[3].shape[0], int((np.asarray(a[5]) > 0).sum()))) or _f(*a, **k))
    got = engine.generate([Request(prompt=p, max_new_tokens=2, temperature=1.0, stop_ids=(1,)) for p in nexts],
                          jax.random.key(1))
    assert shapes == [(4, 3)]
    for p, g in zip(nexts, got):
        np.testing.assert_allclose(g.logprobs, _teacher_forced(graphdef, state, p, [g.tokens])[0], atol=1e-5)


def test_shared_blocks_arrangement():
    """Groups (same first page) fill blocks of G rows in order, never mixed with another group; a block shares the
    leading columns all its rows hold, within every row's full pages; an arrangement needing more rows than the
    plain packing, or sharing nothing, is None."""
    from posttrain.generate.kv_pages import shared_blocks

    table = np.asarray([[1, 2, 5], [7, 8, 9], [1, 2, 6], [1, 3, 4], [7, 8, 10], [11, 0, 0]])
    full = np.asarray([2, 2, 2, 2, 1, 0])
    row, shared = shared_blocks(table, full, 2, 8)
    # group of page 1: rows 0, 2 (share 2 pages), then 3 alone (its own full pages); group of page 7: 1, 4 (share
    # 1: row 4 holds one full page); row 5 (no full page) alone
    assert row.tolist() == [0, 2, 3, -1, 1, 4, 5, -1] and shared.tolist() == [2, 2, 1, 0]
    assert shared_blocks(table, full, 2, 6) is None  # 4 blocks of 2 do not fit 6 rows
    assert shared_blocks(table, full, 3, 7).__class__ is tuple  # rows rounded up to 9: 3 blocks of 3
    assert shared_blocks(table[5:], full[5:], 2, 2) is None  # nothing shared


def test_shared_prefix_decode_equals_the_plain_decode(monkeypatch):
    """Two groups of 3 samples (prompts of 9 and 13 tokens: 2 and 3 full pages) and 6 slots: the decode runs in
    blocks of 3 rows reading each group's prompt pages once (`paged_attention.shared_prefix_attention`), with the
    tokens of the plain decode (`kv_pages.shared_blocks` off) and logprobs within 1e-5 of it and of a
    teacher-forced forward."""
    from posttrain.generate.engine import loop

    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(11)
    prompts = [tuple(rng.integers(4, cfg.vocab_size, n).tolist()) for n in (9, 13)]
    requests = [Request(prompt=p, max_new_tokens=8, temperature=1.0, stop_ids=(1,)) for p in prompts for _ in range(3)]
    settings = EngineSettings(num_slots=6, num_pages=40, page_size=Z, max_seq_len=40, prefill_bucket=32)
    shared, real = [], loop.decode_chunk
    monkeypatch.setattr(loop, "decode_chunk",
                        lambda *a, **k: shared.append(k["shared"] is not None) or real(*a, **k))
    got = Engine(graphdef, state, settings).generate(requests, jax.random.key(3))
    assert shared and all(shared[:4]), shared  # all 6 live: 2 blocks of 3
    monkeypatch.setattr(loop.kv_pages, "shared_blocks", lambda *a: None)
    shared.clear()
    plain = Engine(graphdef, state, settings).generate(requests, jax.random.key(3))
    assert not any(shared)
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    for i, p in enumerate(prompts):
        group = got[3 * i:3 * i + 3]
        for g, want in zip(group, _teacher_forced(graphdef, state, p, [g.tokens for g in group])):
            np.testing.assert_allclose(g.logprobs, want, atol=1e-5)
    assert len({tuple(g.tokens) for g in got}) > 2
