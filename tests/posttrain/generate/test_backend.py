"""`sampling.backend = "engine"`: the rollout engine behind `Rollouter.sample_fn` (generate.backend).

Tokens and logprobs equal the dense sampler's through the same sample_fn, sampled ones too (the same key: the same
uniforms); greedy ones (tiny-dense, f32 at precision
highest, <= 1e-5), for a group's first turn, a next turn that extends it (prefix reuse) and new weights (a swap:
versions move on); a 2-step GRPO run of configs/tiny.py with the engine records sampler logprobs equal to the
trainer's teacher-forced ones (<= 1e-5; the dense sampler's test allows mean 1e-4, max 1e-3); bad settings are one
ConfigError each.
"""
import dataclasses
import types

import jax
import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.infra.mesh import make_mesh
from posttrain.config.plan import make_run_plan
from posttrain.generate import backend
from posttrain.rollout.rollouter import Rollouter
from posttrain.generate.sampler import SamplingParams, pad_prompts
from helpers import random_model, tiny_config

STOPS, PAD = (1, 2, 3), 2
LG = 16
LENGTHS = (5, 11, 8, 3, 17, 9)  # test_engine.py's prompts: stopped and truncated greedy replies


def _rollouters(tmp_path, graphdef):
    """(dense, engine) Rollouters of one plan (4 prompts x 3 samples), sharing everything but the engine."""
    plan = make_run_plan(tiny_config(tmp_path, **{"sampling.backend": "engine", "rl.group_size": 3}))
    settings = plan.rollout_settings
    assert settings.engine == backend.EngineSamplerSettings(num_slots=12)  # P x G slots, sized by requests
    mesh = make_mesh({"fsdp": 1}, jax.devices()[:1])
    sized = dataclasses.replace(settings.engine, page_size=4, max_seq_len=64)  # one size for both turns
    engine = backend.EngineSampler(graphdef, sized, jax.devices()[0])
    r = Rollouter(settings=settings, mesh=mesh, graphdef=graphdef, runner=None, scheduler=None, train_specs={},
                  tokenizer=types.SimpleNamespace(stop_ids=STOPS, pad_id=PAD), advantage_fn=None, engine=engine)
    return dataclasses.replace(r, engine=None), r


def _check_equal(dense, engine, version):
    d, e = (jax.tree.map(np.asarray, o) for o in (dense, engine))
    np.testing.assert_array_equal(e.lengths_N, d.lengths_N)
    np.testing.assert_array_equal(e.truncated_N, d.truncated_N)
    np.testing.assert_array_equal(e.tokens_NxLg, d.tokens_NxLg)  # pad after the stop token on both
    np.testing.assert_allclose(e.logp_NxLg, d.logp_NxLg, atol=1e-5, rtol=0)  # 0 after the stop token on both
    valid = np.arange(LG)[None] < d.lengths_N[:, None]
    assert (e.versions_NxLg[valid] == version).all() and (e.versions_NxLg[~valid] == -1).all()
    assert d.versions_NxLg is None
    return d


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampled_engine_backend_equals_dense_through_sample_fn(tmp_path, temperature, top_k, top_p):
    """At T > 0 too (with and without top-k / top-p) the engine draws the dense sampler's tokens from the same key:
    request r's t-th token takes the dense sampler's uniform of row r at step t (`engine_sampling.token_uniforms`);
    6 prompts x G = 3 over 12 slots (6 requests queued), then their next turns (G = 1, another key). The two
    samplers' logits differ by float rounding only, far from a token boundary at these sizes."""
    cfg, graphdef, state = random_model("tiny-dense", matmul_precision="highest")
    dense, engine = _rollouters(tmp_path, graphdef)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, cfg.vocab_size, n).tolist() for n in LENGTHS]
    toks, lens = pad_prompts(prompts, PAD, bucket=8)
    params = SamplingParams(max_new_tokens=LG, temperature=temperature, top_k=top_k, top_p=top_p)
    d = _check_same_draws(dense.sample_fn((state,), params)(toks, lens, jax.random.key(4), 3),
                          engine.sample_fn((state,), params)(toks, lens, jax.random.key(4), 3), unfiltered=top_k == 0)
    assert len({tuple(r) for r in d.tokens_NxLg[:3]}) > 1  # a group's samples differ: draws, not argmax
    contexts = [prompts[n // 3] + d.tokens_NxLg[n, :d.lengths_N[n]].tolist() + [7, 8] for n in range(18)]
    toks2, lens2 = pad_prompts(contexts, PAD, bucket=8)
    _check_same_draws(dense.sample_fn((state,), params)(toks2, lens2, jax.random.key(5), 1),
                      engine.sample_fn((state,), params)(toks2, lens2, jax.random.key(5), 1), unfiltered=top_k == 0)


def _check_same_draws(dense, engine, unfiltered: bool):
    """Every row equal (tokens, logprobs <= 1e-5) but at most 2 of them, each equal up to a first difference where
    rounding moved a draw across a token boundary: there the tokens are neighbours in the vocabulary (the inverse
    CDF runs over token ids) when nothing is filtered out. Returns the dense side."""
    d, e = (jax.tree.map(np.asarray, o) for o in (dense, engine))
    differ = [n for n in range(len(d.lengths_N)) if not np.array_equal(d.tokens_NxLg[n], e.tokens_NxLg[n])]
    assert len(differ) <= 2, differ
    for n in range(len(d.lengths_N)):
        i = np.flatnonzero(d.tokens_NxLg[n] != e.tokens_NxLg[n])[0] if n in differ else LG
        np.testing.assert_allclose(e.logp_NxLg[n, :i], d.logp_NxLg[n, :i], atol=1e-5, rtol=0)
        if n in differ and unfiltered:
            assert abs(int(d.tokens_NxLg[n, i]) - int(e.tokens_NxLg[n, i])) == 1, (n, i)
    return d


def test_token_uniforms_are_the_dense_samplers_whatever_the_width():
    """Row r's uniform at step t is element r of `uniform(fold_in(key, t), (N,))` for every N > r (the dense
    sampler's draw), for each of K steps from each row's own t."""
    from posttrain.generate.engine.sampling import token_uniforms, uniform_width

    key = jax.random.key(9)
    request, t = np.asarray([0, 5, 70, 3]), np.asarray([0, 2, 7, 1])
    for width in (uniform_width(70), 512):
        u = np.asarray(token_uniforms(key, request, t, steps=3, width=width))
        for s, (r, t0) in enumerate(zip(request, t)):
            for j in range(3):
                for n in (r + 1, 100):
                    assert u[j, s] == np.asarray(jax.random.uniform(jax.random.fold_in(key, t0 + j), (n,)))[r]
    assert uniform_width(0) == 64 and uniform_width(63) == 64 and uniform_width(64) == 128


def test_greedy_engine_backend_equals_dense_through_sample_fn(tmp_path):
    """Turn 1: 6 prompts x G = 3 over 12 slots (stopped and truncated replies); turn 2: each reply's context plus
    3 bridge tokens (G = 1), read from the pages of turn 1 (prefix cache); then perturbed weights: version 1, the
    dense sampler's tokens under them."""
    cfg, graphdef, state = random_model("tiny-dense", matmul_precision="highest")
    dense, engine = _rollouters(tmp_path, graphdef)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, cfg.vocab_size, n).tolist() for n in LENGTHS]
    toks, lens = pad_prompts(prompts, PAD, bucket=8)
    params = SamplingParams(max_new_tokens=LG, temperature=0.0)
    key = jax.random.key(0)
    d = _check_equal(dense.sample_fn((state,), params)(toks, lens, key, 3),
                     engine.sample_fn((state,), params)(toks, lens, key, 3), version=0)
    assert d.lengths_N.min() < LG and d.lengths_N.max() == LG and d.truncated_N.any()
    first = engine.engine.pop_metrics()
    assert first["rollout/prefix_cached_tokens"] > 0  # the group's samples share their prompt's full pages
    contexts = [prompts[n // 3] + d.tokens_NxLg[n, :d.lengths_N[n]].tolist() + [7, 8, 9] for n in range(18)]
    toks2, lens2 = pad_prompts(contexts, PAD, bucket=8)
    fn = engine.sample_fn((state,), params)  # the same arrays: no swap, the cache stays
    _check_equal(dense.sample_fn((state,), params)(toks2, lens2, key, 1), fn(toks2, lens2, key, 1), version=0)
    second = engine.engine.pop_metrics()
    assert second["rollout/weight_swaps"] == 0
    assert second["rollout/prefill_tokens"] + second["rollout/prefix_cached_tokens"] == lens2.sum()
    # at least every full page of turn 1 (prompt + reply but its last token, never fed) is read from the cache
    assert second["rollout/prefix_cached_tokens"] >= sum((len(c) - 4) // 4 * 4 for c in contexts)
    new = jax.tree.map(lambda x: x * 1.01, state)
    d3 = _check_equal(dense.sample_fn((new,), params)(toks, lens, key, 3),
                      engine.sample_fn((new,), params)(toks, lens, key, 3), version=1)
    third = engine.engine.pop_metrics()
    assert third["rollout/weight_swaps"] == 1  # the old version's pages serve nothing: only the group's sharing
    assert third["rollout/prefix_cached_tokens"] == first["rollout/prefix_cached_tokens"]
    deliveries = []  # streaming scoring: every 4 decode steps the rows finished so far, final once delivered
    streamed = engine.engine.sample_fn((new,), params, STOPS, PAD, stream_chunk=4)(
        toks, lens, key, 3, on_rows=lambda *rows: deliveries.append(rows))
    _check_equal(d3, streamed, version=1)
    assert 1 <= len(deliveries) and deliveries[0][0].sum() < 18  # some rows before the last ones finished
    for finished, tokens, lengths in deliveries:
        np.testing.assert_array_equal(tokens[finished], d3.tokens_NxLg[finished])
        np.testing.assert_array_equal(lengths[finished], d3.lengths_N[finished])


def test_arrays_sampled_before_they_are_published_take_their_published_version(tmp_path):
    """An evaluation (the eval gate) samples the learner's new state before the rollout queue publishes it as
    version 1: that call is labelled with the newest published version (0); the training call after the publish,
    with the same arrays, records version 1 on every token (it recorded 0 before the relabel, and the queue refused
    the batch as stale at rollout.max_staleness=0)."""
    cfg, graphdef, state = random_model("tiny-dense", matmul_precision="highest")
    _, r = _rollouters(tmp_path, graphdef)
    toks, lens = pad_prompts([[5, 6, 7], [8, 9]], PAD, bucket=4)
    params = SamplingParams(max_new_tokens=LG, temperature=0.0)

    def versions(policy):
        out = r.sample_fn(policy, params)(toks, lens, jax.random.key(0), 1)
        return set(np.asarray(out.versions_NxLg)[np.arange(LG)[None] < np.asarray(out.lengths_N)[:, None]].tolist())

    r.engine.publish((state,), 0, live=False)
    assert versions((state,)) == {0}
    new = (jax.tree.map(lambda x: x * 1.01, state),)
    assert versions(new) == {0}  # not published yet: the newest published number
    r.engine.publish(new, 1, live=False)
    assert versions(new) == {1} and r.engine.version == 1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-routing-replay"])
def test_two_step_grpo_run_with_the_engine(tmp_path, moe, monkeypatch):
    """configs/tiny.py's base with sampling.backend=engine, 2 steps at T = 1: every sampled token's logprob equals
    the trainer's teacher-forced one (rollout/logp_diff_*: <= 1e-5, f32 at precision highest; on tiny-moe with
    routing replay the trainer replays the engine's recorded experts), the engine's counters are logged and step 2
    ran under new weights (one swap)."""
    import json

    from posttrain.recipes import grpo

    from posttrain.rollout import batching

    over = {"model.preset": "tiny-moe", "rl.routing_replay": "replay"} if moe else {}
    cfg = tiny_config(tmp_path, **{"sampling.backend": "engine", "train.steps": 2,
                                   "model.matmul_precision": "highest", **over})
    replayed, routed_experts = [], batching._routed_experts  # the batches' replay arrays (None: no routing)
    monkeypatch.setattr(batching, "_routed_experts", lambda *a: replayed.append(routed_experts(*a)) or replayed[-1])
    grpo.train(cfg, progress=False)
    if moe:  # every training batch replays the engine's records: each row's first token has its experts
        assert len(replayed) >= 2 and all(r is not None and (r[:, 0] >= 0).all() for r in replayed)
    else:
        assert replayed and all(r is None for r in replayed)
    rows = [m for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if "rollout/logp_diff_max" in m]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["rollout/logp_diff_mean"] <= 1e-5 and m["rollout/logp_diff_max"] <= 1e-5, m
        assert m["rollout/decode_tokens"] > 0 and m["rollout/prefix_cached_tokens"] > 0
        assert m["rollout/preemptions"] == 0 and 0 < m["rollout/slot_occupancy"] <= 1
    assert [m["rollout/weight_swaps"] for m in rows] == [0, 1]


def test_backend_names_and_settings_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        tiny_config(tmp_path, **{"sampling.backend": "paged"})
    assert str(info.value) == "sampling.backend='paged'; expected one of ('auto', 'engine', 'dense')"
    with pytest.raises(ConfigError, match=r"sampling.engine_pages=1 is out of range: must be 0 \(every slot"):
        tiny_config(tmp_path, **{"sampling.engine_pages": 1})
    engine = {"sampling.backend": "engine"}
    with pytest.raises(ConfigError, match="^sampling.backend='engine' runs on one device .*, this run's sampler "
                                          "has 2: use sampling.backend='dense', or mesh.rollout=1"):
        make_run_plan(tiny_config(tmp_path, **engine), num_devices=2)
    replay = make_run_plan(tiny_config(tmp_path, **engine, **{"rl.routing_replay": "replay"})).engine
    assert replay.record_routing and replay.engine_settings(10).record_routing  # routing replay: the engine records
    with pytest.raises(ConfigError, match=r"^sampling.engine_per_episode=True needs sampling.engine_max_seq_len > 0"):
        make_run_plan(tiny_config(tmp_path, **engine, **{"sampling.engine_per_episode": True}))
    per_episode = make_run_plan(tiny_config(tmp_path, **engine, **{"sampling.engine_per_episode": True,
                                                                   "sampling.engine_max_seq_len": 256}))
    assert per_episode.engine.per_episode and per_episode.engine.env_overlap == 0
    with pytest.raises(ConfigError, match=r"^sampling.engine_env_overlap=2 overlaps .* needs "
                                          r"sampling.engine_per_episode=True"):
        make_run_plan(tiny_config(tmp_path, **engine, **{"sampling.engine_env_overlap": 2}))
    with pytest.raises(ConfigError, match=r"sampling.engine_env_overlap=-1 is out of range"):
        tiny_config(tmp_path, **{"sampling.engine_env_overlap": -1})
    with pytest.raises(ConfigError, match=r"sampling.engine_decode_chunk=-2 is out of range"):
        tiny_config(tmp_path, **{"sampling.engine_decode_chunk": -2})
    chunked = make_run_plan(tiny_config(tmp_path, **engine, **{"sampling.engine_decode_chunk": 4})).engine
    assert chunked.decode_chunk == 4 and chunked.engine_settings(40).decode_chunk == 4
    assert per_episode.engine.engine_settings(40).decode_chunk == 0  # the backend's default
    with pytest.raises(ValueError, match=r"per_episode=True"):
        backend.EngineSamplerSettings(num_slots=2, per_episode=True)
    # the default, "auto": the engine on one device; the dense sampler on more, or when asked to shrink rows
    assert make_run_plan(tiny_config(tmp_path)).engine is not None
    assert make_run_plan(tiny_config(tmp_path), num_devices=2).engine is None
    assert make_run_plan(tiny_config(tmp_path, **{"sampling.decode_shrink_steps": 2})).engine is None
    assert make_run_plan(tiny_config(tmp_path, **{"sampling.backend": "dense"})).engine is None
    partial = {"rollout.max_staleness": 1, "rollout.partial": True}
    assert make_run_plan(tiny_config(tmp_path, **partial)).engine is not None
    with pytest.raises(ConfigError, match=r"^rollout.partial=True .* needs the rollout engine .* this run samples "
                                          r"with the dense sampler \(sampling.backend='auto', 2 sampler devices"):
        make_run_plan(tiny_config(tmp_path, **partial), num_devices=2)
    plan = make_run_plan(tiny_config(tmp_path, **engine, **{"sampling.engine_slots": 5, "sampling.engine_pages": 9,
                                                             "sampling.engine_max_seq_len": 64}))
    s = plan.engine
    assert s.engine_settings(10) == s.engine_settings(60)  # a fixed size: 5 slots, 9 pages of 16, 64 tokens
    assert (s.engine_settings(10).num_pages, s.engine_settings(10).max_seq_len) == (9, 64)
    grown = backend.EngineSamplerSettings(num_slots=4).engine_settings(70)  # 70 -> 8 pages of 16
    assert (grown.max_seq_len, grown.num_pages) == (128, 4 * 8 + 1)
