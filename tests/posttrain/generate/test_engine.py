"""The paged continuous-batching engine: greedy tokens and logprobs equal today's sampler with more requests than
slots (tiny-dense GQA and tiny-deepseek MLA), teacher-forced logprobs equal the engine's under per-request settings
(<= 1e-5, f32 at precision highest), a pool too small for all sequences preempts and still completes every request
with the same tokens, and pages allocated minus used stay under one page per live sequence.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.learn.logprobs import token_logprobs
from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.engine.ops import filter_logits_rows
from posttrain.generate.kv_pages import PagePool
from posttrain.generate.sampler import SamplingParams, filter_logits, pad_prompts, sample
from helpers import random_model

STOPS = (1, 2, 3)
LG = 16  # reply budget
LENGTHS = (5, 11, 8, 3, 17, 9)  # 6 requests over 4 slots


def _prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).tolist() for n in LENGTHS]


@functools.lru_cache(maxsize=None)
def _greedy_sampler(preset, **overrides):
    """(cfg, graphdef, state, prompts, tokens [N, LG], logp [N, LG], lengths [N]) of today's sampler, greedy."""
    cfg, graphdef, state = random_model(preset, **overrides)
    prompts = _prompts(cfg.vocab_size)
    tokens, lengths = pad_prompts(prompts, 2, bucket=32)
    out = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), group_size=1,
                 params=SamplingParams(max_new_tokens=LG, temperature=0.0), stop_ids=STOPS, pad_id=2)
    return (cfg, graphdef, state, prompts, np.asarray(out.tokens_NxLg), np.asarray(out.logp_NxLg),
            np.asarray(out.lengths_N))


def _check_equal_to_sampler(completions, tokens, logp, lengths):
    for i, c in enumerate(completions):
        n = lengths[i]
        np.testing.assert_array_equal(c.tokens, tokens[i, :n], err_msg=f"request {i}")
        np.testing.assert_allclose(c.logprobs, logp[i, :n], atol=1e-5, err_msg=f"request {i}")
        assert c.truncated == (n == LG and tokens[i, n - 1] not in STOPS)


def _engine(graphdef, state, num_pages):
    return Engine(graphdef, state, EngineSettings(num_slots=4, num_pages=num_pages, page_size=4, max_seq_len=40,
                                                  prefill_bucket=32, drain_chunk=1))  # one step a program


def test_greedy_equals_sampler_through_pool_exhaustion():
    """6 requests over 4 slots with 11 allocatable pages of 4 tokens (4 slots of up to 33 tokens would need 36):
    the newest sequences are preempted (pages freed, recomputed later) and every request still ends with the
    sampler's greedy tokens and logprobs (<= 1e-5); pages allocated - used <= 1 per live sequence at every step."""
    cfg, graphdef, state, prompts, tokens, logp, lengths = _greedy_sampler("tiny-dense")
    assert lengths.min() < LG and lengths.max() == LG  # stopped and truncated requests both covered
    engine = _engine(graphdef, state, num_pages=12)
    requests = [Request(prompt=tuple(p), max_new_tokens=LG, temperature=0.0, stop_ids=STOPS) for p in prompts]
    completions = engine.generate(requests, jax.random.key(0))
    _check_equal_to_sampler(completions, tokens, logp, lengths)
    m = engine.metrics
    assert m["rollout/preemptions"] >= 2 and m["rollout/preemptions"] == sum(c.preemptions for c in completions)
    assert m["rollout/prefill_tokens"] > sum(LENGTHS)  # recompute prefills prompt + tokens so far
    assert m["rollout/decode_tokens"] == lengths.sum() - len(LENGTHS)  # fresh first tokens come from the prefill
    assert m["rollout/kv_pages_used"] <= m["rollout/kv_pages_allocated"] <= 11
    assert 0.5 < m["rollout/slot_occupancy"] <= 1.0
    assert engine.max_waste_per_seq <= 1.0


@pytest.mark.parametrize("count", [6, 3])
def test_an_admission_prefills_its_requests_in_one_program(monkeypatch, count):
    """The first admission fills all 4 slots with one `prefill` of 4 rows (3 requests: 3 rows and an empty one,
    which writes only into the scratch page); a later one of n requests is one program of the next power of two
    >= n rows. Tokens and logprobs equal the sampler's (<= 1e-5) either way."""
    from posttrain.generate.engine import admission

    cfg, graphdef, state, prompts, tokens, logp, lengths = _greedy_sampler("tiny-dense")
    calls, real = [], admission.prefill

    def counted(graphdef, state, pool, tokens_BxW, lengths_B, *args, **kw):
        calls.append((tuple(tokens_BxW.shape), int((np.asarray(lengths_B) > 0).sum())))
        return real(graphdef, state, pool, tokens_BxW, lengths_B, *args, **kw)

    monkeypatch.setattr(admission, "prefill", counted)
    engine = _engine(graphdef, state, num_pages=40)  # room for every sequence: no preemption
    requests = [Request(prompt=tuple(p), max_new_tokens=LG, temperature=0.0, stop_ids=STOPS) for p in prompts]
    completions = engine.generate(requests[:count], jax.random.key(0))
    _check_equal_to_sampler(completions, tokens[:count], logp[:count], lengths[:count])
    assert calls[0] == ((4, 32), min(count, 4))  # every prompt fits the 32-token bucket
    assert sum(n for _, n in calls) == count and len(calls) < count
    assert all(shape == (1 << (n - 1).bit_length(), 32) for shape, n in calls[1:]), calls


@pytest.mark.parametrize("moe", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["mla", "mla-moe"])
def test_greedy_equals_sampler_mla(moe):
    """tiny-deepseek: MLA's compressed entry paged as one kv head of keys and values, a pool with room for every
    sequence: no preemption, prefill tokens = prompt tokens. Default: its MLP layers dense (moe=None; the MoE
    compile doubles the cost and its layers do not touch the cache); slow: with its MoE stack (~70 s)."""
    cfg, graphdef, state, prompts, tokens, logp, lengths = _greedy_sampler("tiny-deepseek",
                                                                           **({} if moe else {"moe": None}))
    engine = _engine(graphdef, state, num_pages=40)
    requests = [Request(prompt=tuple(p), max_new_tokens=LG, temperature=0.0, stop_ids=STOPS) for p in prompts]
    completions = engine.generate(requests, jax.random.key(0))
    _check_equal_to_sampler(completions, tokens, logp, lengths)
    m = engine.metrics
    assert m["rollout/preemptions"] == 0 and m["rollout/prefill_tokens"] == sum(LENGTHS)
    assert engine.max_waste_per_seq <= 1.0


def test_teacher_forced_logprobs_equal_engine_per_request_settings():
    """Requests with their own temperature, top-k, top-p, stop ids and budget: each reply respects its own
    settings, and one teacher-forced forward at each request's T reproduces every logprob (<= 1e-5)."""
    cfg, graphdef, state = random_model("tiny-dense")
    prompts = _prompts(cfg.vocab_size, seed=1)
    settings = [(1.0, 0, 1.0, (1, 2), 16), (0.7, 10, 1.0, (3,), 12), (0.0, 0, 1.0, (5, 6), 16),
                (1.3, 0, 0.8, (7,), 9), (0.9, 20, 0.9, (), 16), (1.0, 0, 1.0, tuple(range(1, 40)), 16)]
    requests = [Request(prompt=tuple(p), temperature=T, top_k=k, top_p=tp, stop_ids=st, max_new_tokens=b)
                for p, (T, k, tp, st, b) in zip(prompts, settings)]
    engine = _engine(graphdef, state, num_pages=12)  # the engine size of the first test: no second compile
    completions = engine.generate(requests, jax.random.key(3))
    rows = [list(r.prompt) + c.tokens.tolist() for r, c in zip(requests, completions)]
    seq = np.zeros((len(rows), 40), np.int32)
    seg = np.zeros_like(seq)
    for i, r in enumerate(rows):
        seq[i, :len(r)], seg[i, :len(r)] = r, 1
    T = jnp.asarray([r.temperature or 1.0 for r in requests])[:, None, None]  # the trainer's T per row

    def trainer(state, seq, seg):  # the trainer's definition: learn.logprobs.token_logprobs at each row's T
        logits = nnx.merge(graphdef, state)(seq, None, seg)[0]
        return logits, token_logprobs(logits, jnp.roll(seq, -1, axis=1), T)

    logits, logp_tf = (np.asarray(a) for a in jax.jit(trainer)(state, seq, seg))
    for r, c, i in zip(requests, completions, range(len(rows))):
        n, lp = len(c.tokens), len(r.prompt)
        assert 1 <= n <= r.max_new_tokens
        assert not np.isin(c.tokens[:-1], r.stop_ids).any()  # only its own stop ids end it, kept last
        assert c.truncated == (c.tokens[-1] not in r.stop_ids) and (c.truncated <= (n == r.max_new_tokens))
        scaled = logits[i, lp - 1: lp - 1 + n] / (r.temperature or 1.0)
        np.testing.assert_allclose(c.logprobs, logp_tf[i, lp - 1: lp - 1 + n], atol=1e-5, err_msg=f"request {i}")
        if r.temperature == 0:
            np.testing.assert_array_equal(c.tokens, scaled.argmax(-1))
        if r.top_k or r.top_p < 1:  # drawn tokens lie inside the filtered set
            kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(scaled), r.top_k, r.top_p)))
            assert kept[np.arange(n), c.tokens].all()
    assert completions[5].tokens.size < 16  # ~30% of the vocabulary stops request 5


def test_filter_logits_rows_equals_filter_logits_per_row():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 50)) * 2, jnp.float32)
    cases = [(0, 1.0), (5, 1.0), (0, 0.7), (10, 0.5), (50, 0.99), (1, 0.3)]
    both = jax.jit(lambda x: (filter_logits_rows(x, jnp.asarray([k for k, _ in cases]),
                                                 jnp.asarray([p for _, p in cases])),
                              [filter_logits(x[i:i + 1], k, p)[0] for i, (k, p) in enumerate(cases)]))
    got, want = both(x)  # one compile for all cases
    for i, case in enumerate(cases):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want[i]), err_msg=str(case))
    assert np.isinf(np.asarray(got)).sum(1)[[1, 5]].tolist() == [45, 49]  # top-k 5 and 1 mask the rest


def test_page_pool_and_bad_input():
    pool = PagePool(num_pages=6, num_slots=2, pages_per_seq=3, page_size=4)
    assert pool.grow(0, 5) and pool.table_SxM[0, :2].tolist() == [1, 2] and pool.allocated == 2
    assert pool.grow(1, 12) and not pool.grow(0, 9)  # 5 allocatable pages, 5 held: nothing allocated
    assert pool.held_S.tolist() == [2, 3]
    pool.release(1)
    assert pool.table_SxM[1].tolist() == [0, 0, 0] and pool.grow(0, 12) and pool.allocated == 3
    with pytest.raises(ValueError, match="13 tokens need 4 pages, the page table holds 3"):
        pool.grow(0, 13)
    with pytest.raises(ValueError, match="num_pages=1"):
        PagePool(num_pages=1, num_slots=1, pages_per_seq=1, page_size=1)
    with pytest.raises(ValueError, match="top_p=0"):
        Request(prompt=(4, 5), max_new_tokens=3, top_p=0)
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        Request(prompt=(), max_new_tokens=3)
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        EngineSettings(num_slots=2, num_pages=4, attention_impl="flash")
    cfg, graphdef, state = random_model("tiny-dense")
    engine = Engine(graphdef, state, EngineSettings(num_slots=2, num_pages=5, page_size=4, max_seq_len=40))
    with pytest.raises(ValueError, match=r"request 1: prompt 10 \+ max_new_tokens 8 = 18 tokens \(5 pages"):
        engine.check([Request(prompt=(4,), max_new_tokens=2), Request(prompt=(4,) * 10, max_new_tokens=8)])
    with pytest.raises(TypeError, match="request 0: expected engine.Request, got tuple"):
        engine.check([(4, 5)])


def test_table_width_narrows_to_live_pages_with_equal_results(monkeypatch):
    """With the gather reference the decode and extend programs get the page table only as wide as the longest
    live sequence needs (2, 4, 6, 8 pages, then four widths per octave, <= M); a multi-turn episode through a wide engine (M = 64) gives the
    same tokens and logprobs (<= 1e-5: summation order) as with the full table, and the programs saw the narrow widths only."""
    assert [EngineSettings(num_slots=1, num_pages=2, page_size=4, max_seq_len=m).table_width(p)
            for m, p in [(40, 1), (40, 8), (40, 9), (40, 10), (256, 9), (256, 17), (256, 64), (16, 1), (256, 3),
                         (1024, 33), (1024, 41), (1024, 100)]] == [2, 8, 10, 10, 10, 20, 64, 2, 4, 40, 48, 112]
    cfg, graphdef, state = random_model("tiny-dense")
    rng = np.random.default_rng(3)
    first = rng.integers(4, cfg.vocab_size, 7).tolist()
    settings = EngineSettings(num_slots=4, num_pages=80, page_size=4, max_seq_len=256, prefill_bucket=32)
    from posttrain.generate.engine import loop
    import posttrain.generate.engine.admission as admission_module

    modules = {"decode_chunk": loop, "extend": admission_module}

    def run():
        widths, calls = set(), {}
        for name in ("decode_chunk", "extend"):
            real = getattr(modules[name], name)
            calls[name] = real

            def spy(*args, _real=real, _at=3 if name == "decode_chunk" else 6, **kw):
                widths.add((_real.__name__, args[_at].shape[-1]))
                return _real(*args, **kw)
            monkeypatch.setattr(modules[name], name, spy)
        engine, prompt, out = Engine(graphdef, state, settings), list(first), []
        for turn in range(3):
            reqs = [Request(prompt=tuple(prompt), max_new_tokens=12, temperature=0.0, stop_ids=(1,))] * 2
            done = engine.generate(reqs, jax.random.key(turn))
            out.append(done)
            prompt = prompt + done[0].tokens.tolist() + [5, 6, 7]
        for name, real in calls.items():
            monkeypatch.setattr(modules[name], name, real)
        return out, widths

    narrow, widths = run()
    assert {w for _, w in widths} <= {2, 4, 6, 8, 10, 12, 14, 16} and {name for name, _ in widths} == {"decode_chunk", "extend"}
    monkeypatch.setattr(EngineSettings, "table_width", lambda self, pages: self.pages_per_seq)
    full, full_widths = run()
    assert {w for _, w in full_widths} == {64}
    for a, b in zip(narrow, full):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_decode_packs_live_slots_into_fewer_rows_with_equal_results(monkeypatch):
    """12 slots, 12 sampled requests of budgets 1..12: as they end the decode runs on the smallest multiple of 3
    rows that holds the live ones (12, 9, 6, 3: `EngineSettings.decode_rows`), live slots packed first; tokens
    equal and logprobs within 1e-5 of decoding all 12 slots every step, and every token is the draw of its own
    request's uniform from the teacher-forced logits, whichever row it ran in."""
    from posttrain.generate.engine import loop

    assert [EngineSettings(num_slots=s, num_pages=2).decode_rows(n) for s, n in
            [(64, 64), (64, 49), (64, 48), (64, 1), (8, 1), (12, 5), (13, 5)]] == [64, 64, 48, 16, 8, 6, 8]
    cfg, graphdef, state = random_model("tiny-dense")
    prompts = [np.random.default_rng(i).integers(4, cfg.vocab_size, 5 + i % 3).tolist() for i in range(12)]
    requests = [Request(prompt=tuple(p), max_new_tokens=1 + i, temperature=1.0) for i, p in enumerate(prompts)]
    settings = EngineSettings(num_slots=12, num_pages=40, page_size=4, max_seq_len=24, prefill_bucket=32,
                              drain_chunk=1)
    rows, real = [], loop.decode_chunk
    monkeypatch.setattr(loop, "decode_chunk", lambda *a, **k: rows.append(a[3].shape[0]) or real(*a, **k))
    packed = Engine(graphdef, state, settings).generate(requests, jax.random.key(5))
    assert rows == sorted(rows, reverse=True) and set(rows) == {12, 9, 6, 3}, rows
    monkeypatch.setattr(EngineSettings, "decode_rows", lambda self, live: self.num_slots)
    rows.clear()
    full = Engine(graphdef, state, settings).generate(requests, jax.random.key(5))
    assert set(rows) == {12}
    for a, b in zip(packed, full):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # each token is the inverse-CDF draw of its request's own uniform (`token_uniforms` of its index and step)
    # from the teacher-forced logits, whichever row it ran in
    from posttrain.generate.engine.sampling import token_uniforms, uniform_width
    from posttrain.generate.sampler import categorical

    seq, seg = np.zeros((12, 24), np.int32), np.zeros((12, 24), np.int32)
    for r, (p, c) in enumerate(zip(prompts, packed)):
        seq[r, :len(p) + len(c.tokens)], seg[r, :len(p) + len(c.tokens)] = p + c.tokens.tolist(), 1
    logits = np.asarray(nnx.merge(graphdef, state)(jnp.asarray(seq), None, jnp.asarray(seg))[0])
    u = np.asarray(token_uniforms(jax.random.key(5), jnp.arange(12), jnp.zeros(12, jnp.int32), steps=12,
                                  width=uniform_width(11)))  # [t, r]
    at = [(r, t, len(p) - 1 + t) for r, (p, c) in enumerate(zip(prompts, packed)) for t in range(len(c.tokens))]
    drawn = categorical(jnp.asarray([u[t, r] for r, t, _ in at]), jnp.asarray([logits[r, i] for r, _, i in at]))
    np.testing.assert_array_equal(np.asarray(drawn), [packed[r].tokens[t] for r, t, _ in at])


@pytest.mark.parametrize("preset,steps", [("tiny-dense", 1), ("tiny-deepseek", 1), ("tiny-deepseek", 3)])
def test_the_decode_step_carries_the_whole_pool_through_the_layer_scan(preset, steps):
    """Each layer writes its new entries into the pool and attends over it where it lies: each stack's layer scan
    carries that stack's whole pool ([K, L * P, Z, H]) and no scan takes a layer's slice of a pool as input.
    (Scanning the layers' pages as [L, K, P, Z, H] made XLA copy each layer's pages for the kernel at every
    step: 2 GiB a layer for qwen3-0.6b at 512 x 1024 tokens, compiled for an H200.) tiny-deepseek: a dense and
    an MoE stack, MLA's single "kv" entry; decode_chunk scans `steps` decode steps around the layer scans."""
    from posttrain.generate.engine import ops as engine_ops
    from posttrain.generate import kv_pages
    from posttrain.generate.engine.loop import request_rows
    from posttrain.generate.paged_attention import flat_pages

    _, graphdef, state = random_model(preset)
    settings = EngineSettings(num_slots=2, num_pages=9, page_size=4, max_seq_len=16)
    pool = kv_pages.empty_pool(kv_pages.pool_shapes(graphdef, state, settings.num_pages, settings.page_size))
    S, M = settings.num_slots, settings.pages_per_seq
    rows = request_rows([Request(prompt=(5,), max_new_tokens=2)] * S)
    i32 = jnp.zeros((S,), jnp.int32)
    args = (graphdef, state, pool, jnp.zeros((S, M), jnp.int32), i32, i32, rows)
    jaxpr = jax.make_jaxpr(lambda pool: engine_ops.decode_chunk(
        *args[:2], pool, *args[3:], jnp.zeros((steps, S)), i32 + 2, jnp.full((S, 1), -1, jnp.int32), steps=steps,
        impl="reference"))(pool)
    scans = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    for name, stack in pool.items():
        whole = sorted(tuple(x.shape) for x in flat_pages(stack).values())
        slices = {(x.shape[1], x.shape[0], *x.shape[2:]) for x in stack.values()}  # [L, K, P, Z, H]
        carrying = []
        for e in scans:
            consts, carry = e.params["num_consts"], e.params["num_carry"]
            carried = sorted(tuple(v.aval.shape) for v in e.invars[consts:consts + carry] if v.aval.ndim == 4)
            scanned = {tuple(v.aval.shape) for v in e.invars[consts + carry:]}
            assert not scanned & slices, (name, scanned & slices)
            if carried == whole:
                carrying.append(e.params["length"])
        assert carrying == [next(iter(stack.values())).shape[1]], (name, carrying)  # one scan, over its L layers


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside its equations (jit, scan, cond bodies)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_decode_chunks_give_the_tokens_of_single_steps(monkeypatch):
    """K = 3 and 4 decode steps per program (`EngineSettings.decode_chunk`, and `drain_chunk` the same), and K = 1
    while requests wait with 4 once none does (`drain_chunk`), give every request the tokens,
    logprobs, versions and truncation of K = 1 (one step a program): per-request temperatures, top-k / top-p,
    stop ids of different counts (one request with none), budgets of 1-16 tokens, a group sharing its prompt's
    pages, and a pool of 12 pages that preempts; with fewer programs run. A chunk allocates each slot's pages for
    its next tokens up front (at most 1 + (K - 1) / Z pages per sequence past what it wrote), and a slot ends
    inside a chunk at its stop token or budget."""
    from posttrain.generate.engine import loop

    cfg, graphdef, state = random_model("tiny-dense")
    prompts = _prompts(cfg.vocab_size, seed=4)
    settings = [(1.0, 0, 1.0, (1, 2), 16), (0.7, 10, 1.0, (3,), 1), (0.0, 0, 1.0, (5, 6, 8), 16),
                (1.3, 0, 0.8, (7,), 9), (0.9, 20, 0.9, (), 16), (1.0, 0, 1.0, tuple(range(1, 40)), 16)]
    requests = [Request(prompt=tuple(p), temperature=T, top_k=k, top_p=tp, stop_ids=st, max_new_tokens=b)
                for p, (T, k, tp, st, b) in zip(prompts, settings)]
    requests += [Request(prompt=tuple(prompts[4]), temperature=1.0, max_new_tokens=14)] * 2  # a group
    programs = []
    real = loop.decode_chunk
    monkeypatch.setattr(loop, "decode_chunk", lambda *a, **kw: programs.append(
        (kw["steps"], bool(engine._queue))) or real(*a, **kw))  # steps, and whether a request waited
    runs = {}
    for K, drain in ((1, 1), (3, 3), (4, 4), (1, 4)):
        programs.clear()
        engine = Engine(graphdef, state, EngineSettings(num_slots=4, num_pages=12, page_size=4, max_seq_len=40,
                                                        prefill_bucket=32, decode_chunk=K, drain_chunk=drain))
        assert engine.chunk_steps == K and engine.drain_steps == drain
        runs[K, drain] = (engine.generate(requests, jax.random.key(5)), engine.metrics, len(programs))
        # chunks of K while a request waits for a slot (4 of the 8 at first, preempted ones later), else of drain
        assert all(steps == (K if waited else drain) for steps, waited in programs), programs
        assert engine.max_waste_per_seq <= 1 + (max(K, drain) - 1) / 4  # pages held past the tokens written
    ones, m1, n1 = runs[1, 1]
    assert m1["rollout/preemptions"] >= 1 and m1["rollout/prefix_cached_tokens"] > 0
    assert [len(c.tokens) for c in ones][1] == 1 and len({len(c.tokens) for c in ones}) >= 4
    assert programs[0] == (1, True) and (4, False) in programs  # the last run, (1, 4)
    for K in ((3, 3), (4, 4), (1, 4)):
        got, m, n = runs[K]
        assert n < n1, (K, n, n1)
        assert m["rollout/decode_tokens"] == m1["rollout/decode_tokens"]
        for i, (a, b) in enumerate(zip(ones, got)):
            np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=f"K={K} request {i}")
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, err_msg=f"K={K} request {i}")  # table widths
            assert b.truncated == a.truncated and b.versions.tolist() == a.versions.tolist()
    assert EngineSettings(num_slots=1, num_pages=2).chunk_steps("gpu") == 8
    assert EngineSettings(num_slots=1, num_pages=2).chunk_steps("cpu") == 1
    assert EngineSettings(num_slots=1, num_pages=2).chunk_steps("cpu", drain=True) == 4
    assert EngineSettings(num_slots=1, num_pages=2, drain_chunk=2).chunk_steps("gpu", drain=True) == 2
    assert EngineSettings(num_slots=1, num_pages=2, decode_chunk=2).chunk_steps("gpu") == 2
    with pytest.raises(ValueError, match="decode_chunk=-1"):
        EngineSettings(num_slots=1, num_pages=2, decode_chunk=-1)
