"""Partial rollouts (issue 24 item 3, `rollout.partial`): the rollout queue publishes the learner's new weights into
the running engine; a generation that spans the swap records per-token versions [v] * a + [v + 1] * b, a sample
counts as its oldest token's version, and the learner's staleness check takes the batch's oldest token."""
import threading

import jax
import numpy as np
import pytest

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.config import ConfigError
from posttrain.infra.mesh import make_mesh
from posttrain.model.tokenizer import Tokenizer
from posttrain.config.plan import make_run_plan
from posttrain.rollout.queue import RolloutQueue, batch_metrics
from posttrain.rollout.rollouter import Rollouter
from helpers import random_model, tiny_config

LG, SWAP_AFTER = 12, 3  # the swap lands after decode chunk 3: a sample admitted first has 5 tokens of version 0


def test_a_generation_spanning_a_published_version_records_both(tmp_path, monkeypatch):
    """max_staleness = 1, 4 prompts x 4 samples over 8 slots. Batch 0 samples with version 0; batch 1 starts at
    once, also with version 0 (admissible), and while it decodes the learner publishes version 1: the 8 samples
    admitted first hold 5 tokens of version 0 (the prefill's + 4 decode steps) and the rest of version 1; the 8
    queued behind them only version 1. Batch 1 is version 0 (its oldest token): staleness 1, not 0."""
    cfg = tiny_config(tmp_path, **{"sampling.backend": "engine", "rollout.max_staleness": 1, "rollout.partial": True,
                                   "sampling.engine_slots": 8, "sampling.max_new_tokens": LG,
                                   "sampling.temperature": 0.0})  # greedy: replies run to the budget
    plan = make_run_plan(cfg)
    _, graphdef, state = random_model("tiny-dense", vocab_size=320)
    r = Rollouter.create(plan.rollout_settings, make_mesh({"fsdp": 1}, jax.devices()[:1]), graphdef, Tokenizer.byte_level(),
                         advantage_fn("grpo"))
    drawn, draw = [], Rollouter.draw
    monkeypatch.setattr(Rollouter, "draw", lambda self, *a: drawn.append(draw(self, *a)) or drawn[-1])
    calls, mid, published = [], threading.Event(), threading.Event()

    def hook(engine, chunk):  # on the producer's thread, after each decode chunk
        calls.append(chunk) if chunk == 0 else None
        if len(calls) == 2 and chunk == SWAP_AFTER:  # batch 1's generation, mid-way: wait for the new weights
            mid.set()
            assert published.wait(120)

    r.engine.chunk_hook = hook
    try:
        with RolloutQueue(r, start=0, steps=2, policy=(state,), rng=jax.random.key(0)) as q:
            b0, _ = q.get(0)
            assert mid.wait(300)
            tree, _ = q.snapshot((jax.tree.map(lambda x: x * 1.01, state),), jax.random.key(1))
            q.publish(1, tree)  # what the learner does after update 1
            published.set()
            b1, _ = q.get(1)
    finally:
        published.set()
        r.close()
    assert b0.version == 0 and all(set(np.concatenate(s.versions).tolist()) == {0} for s in drawn[0][0])
    versions = [np.concatenate(s.versions).tolist() for s in drawn[1][0]]  # group-major: admission order
    assert all(len(v) == LG for v in versions)
    assert versions[:8] == [[0] * (SWAP_AFTER + 2) + [1] * (LG - SWAP_AFTER - 2)] * 8
    assert versions[8:] == [[1] * LG] * 8
    assert [s.oldest_version for s in drawn[1][0]] == [0] * 8 + [1] * 8
    assert b1.version == 0 and b1.staleness() == 1 == batch_metrics(b1, 0.0, 1.0)["rollout/staleness_max"]
    rows = b1.trajectories.records  # one per sample attempt, in run order: each sample's own oldest version
    assert [(row["sample"], row["policy_version"]) for row in rows] == [
        (s, v) for s, v in zip([s for _ in range(4) for s in range(4)], [0] * 8 + [1] * 8)]
    assert b1.trajectories.metrics["rollout/weight_swaps"] == 1
    assert b1.trajectories.metrics["rollout/preemptions"] == 0  # the swap recomputes, it does not preempt


def test_partial_needs_staleness_and_the_engine(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.partial=True needs rollout.max_staleness >= 1"):
        tiny_config(tmp_path, **{"rollout.partial": True, "sampling.backend": "engine"})
    with pytest.raises(ConfigError, match=r"^rollout.partial=True swaps weights inside a running generation: it "
                                          r"needs the rollout engine .* \(sampling.backend='dense', 1 sampler "
                                          r"devices, decode_shrink_steps=0\)$"):
        make_run_plan(tiny_config(tmp_path, **{"rollout.partial": True, "rollout.max_staleness": 1,
                                               "sampling.backend": "dense"}))
    plan = make_run_plan(tiny_config(tmp_path, **{"rollout.partial": True, "rollout.max_staleness": 1,
                                                  "sampling.backend": "engine"}))
    assert plan.config.rollout.partial and plan.engine is not None
