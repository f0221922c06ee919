"""The engine's MoE routing records (`EngineSettings.record_routing`, routing replay): every fed token's expert
selections equal the trainer's teacher-forced routing of the same tokens, through preemption and recompute and a
group's shared prompt pages (prefix cache + extend); the engine sampler's arrays equal the dense sampler's records
of the same greedy replies; a dense model records nothing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.backend import EngineSampler, EngineSamplerSettings
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample
from helpers import random_model

STOPS = (1, 2, 3)
LG = 12
LENGTHS = (5, 11, 8, 3, 17, 9)


@functools.lru_cache(maxsize=None)
def _model(preset):
    return random_model(preset)


@functools.partial(jax.jit, static_argnums=0)
def _routed(graphdef, state, tokens_1xW, segment_1xW):
    return nnx.merge(graphdef, state).hidden_states(tokens_1xW, None, segment_1xW)[1]["routed_experts"]


def _teacher_forced_routing(graphdef, state, tokens, width=64):
    """The MoE layers' selections when the trainer runs `tokens` in one row (right-padded to `width`: one
    compile): int32 [T, L, k]."""
    padded, segment = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    padded[0, :len(tokens)], segment[0, :len(tokens)] = tokens, 1
    return np.asarray(_routed(graphdef, state, padded, segment))[:, 0, :len(tokens)].transpose(1, 0, 2)


def _check(graphdef, state, requests, completions):
    for i, (r, c) in enumerate(zip(requests, completions)):
        fed = list(r.prompt) + c.tokens[:-1].tolist()
        assert c.routing is not None and c.routing.shape[0] == len(fed), (i, None if c.routing is None else
                                                                           c.routing.shape)
        np.testing.assert_array_equal(c.routing, _teacher_forced_routing(graphdef, state, fed), err_msg=f"req {i}")


@pytest.mark.parametrize("decode_chunk", [1, 3])
def test_routing_equals_teacher_forced_through_preemption_and_prefix_reuse(decode_chunk):
    """tiny-deepseek (a dense stack, then the MoE stack; MLA): 8 requests over 4 slots and 13 allocatable pages,
    two of them a group sharing a prompt's pages (read from the prefix cache, the rest `extend`ed): every
    completion's records equal the teacher-forced selections of its prompt and reply, recomputed ones included;
    also with 3 decode steps per program."""
    cfg, graphdef, state = _model("tiny-deepseek")
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(4, cfg.vocab_size, n).tolist()) for n in LENGTHS]
    requests = [Request(prompt=p, max_new_tokens=LG, temperature=0.0, stop_ids=STOPS) for p in prompts]
    requests += [Request(prompt=prompts[4], max_new_tokens=LG, temperature=1.0, stop_ids=STOPS)] * 2  # a group
    engine = Engine(graphdef, state, EngineSettings(num_slots=4, num_pages=14, page_size=4, max_seq_len=40,
                                                    prefill_bucket=32, record_routing=True,
                                                    decode_chunk=decode_chunk))
    completions = engine.generate(requests, jax.random.key(0))
    assert engine.metrics["rollout/preemptions"] >= 1 and engine.metrics["rollout/prefix_cached_tokens"] > 0
    _check(graphdef, state, requests, completions)


def test_engine_sampler_records_the_dense_samplers_routing_layout():
    """Greedy groups (4 prompts x G = 2) through `EngineSampler.sample_fn` with record_routing and through the dense
    sampler (`sample(record_routing=True)`): equal tokens, and equal `prompt_experts_PxLpxLxk` and
    `experts_NxLgxLxk` arrays (-1 where nothing was fed: prompt padding, the last token and past it)."""
    cfg, graphdef, state = _model("tiny-moe")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, cfg.vocab_size, n).tolist() for n in LENGTHS[:4]]
    tokens, lengths = pad_prompts(prompts, 2, bucket=32)
    params = SamplingParams(max_new_tokens=LG, temperature=0.0)
    out = sample(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), group_size=2,
                 params=params, stop_ids=STOPS, pad_id=2, record_routing=True)
    settings = EngineSamplerSettings(num_slots=4, page_size=4, max_seq_len=40, record_routing=True)
    fn = EngineSampler(graphdef, settings).sample_fn(state, params, STOPS, 2)
    got = fn(tokens, lengths, jax.random.key(0), 2)
    d, e = (jax.tree.map(np.asarray, o) for o in (out, got))
    np.testing.assert_array_equal(e.tokens_NxLg, d.tokens_NxLg)
    valid = np.arange(tokens.shape[1])[None] < lengths[:, None]
    np.testing.assert_array_equal(e.prompt_experts_PxLpxLxk[valid], d.prompt_experts_PxLpxLxk[valid])
    assert (e.prompt_experts_PxLpxLxk[~valid] == -1).all()
    np.testing.assert_array_equal(e.experts_NxLgxLxk, d.experts_NxLgxLxk)
    assert (e.experts_NxLgxLxk[np.arange(8), d.lengths_N - 1] == -1).all()


def test_a_dense_model_records_no_routing():
    cfg, graphdef, state = _model("tiny-dense")
    engine = Engine(graphdef, state, EngineSettings(num_slots=2, num_pages=20, page_size=4, max_seq_len=40,
                                                    prefill_bucket=32, record_routing=True))
    (c,) = engine.generate([Request(prompt=(5, 6, 7), max_new_tokens=4, temperature=0.0)], jax.random.key(0))
    assert c.routing is None and len(c.tokens) == 4
