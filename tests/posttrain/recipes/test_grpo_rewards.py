"""GRPO with `rewards.model` and `rewards.judge` (`posttrain.rollout.rewards`) on the tiny config: 2 steps train with
a random tiny-dense reward model (an exported sequence-classification directory) and a random tiny-dense judge
(whose judgements are unparsable: they score `rewards.judge_unparsable_score`); every trained sample's archived
reward is the weighted sum of its env reward, model reward and judge score, the judge's output is archived in its
details, and the step metrics carry the sources' means."""
import json

import jax
import numpy as np
import pytest
from helpers import random_model, tiny_config

from posttrain.scheduling import archive


@pytest.mark.slow  # 55-75 s on 2 loaded cores (the judge's and the reward model's compiles on top of a tiny run);
# the fast cases of tests/posttrain/rollout/test_rewards.py cover the Rewarder, the judge, the scorer and the hook
def test_grpo_runs_with_a_reward_model_and_a_judge(tmp_path):
    from posttrain.checkpoints.reward_model import export_reward_model
    from posttrain.infra import mesh as mesh_lib
    from posttrain.model.reward_head import with_head
    from posttrain.model.tokenizer import Tokenizer
    from posttrain.recipes import grpo

    cfg, graphdef, state = random_model("tiny-dense", seed=5, vocab_size=320)
    mesh = mesh_lib.make_mesh({"fsdp": 1}, jax.devices()[:1])
    _, rm_state = with_head(cfg, graphdef, state, mesh, mesh_lib.RULES, score=np.linspace(-1, 1, cfg.d_model))
    export_reward_model(cfg, rm_state, tmp_path / "rm", tokenizer=Tokenizer.byte_level())
    weights = {"env": 1.0, "model": 0.5, "judge": 2.0}
    run = tmp_path / "run"
    summary = grpo.train(tiny_config(run, **{
        "train.steps": 2, "rewards.model": str(tmp_path / "rm"), "rewards.weights": weights,
        "rewards.judge.enabled": True, "rewards.judge.preset": "tiny-dense",
        "rewards.judge.overrides": {"vocab_size": 320}, "rewards.judge.max_new_tokens": 3,
        "rewards.judge.template": "{rubric}\n{prompt}\n{reply}",
        "rewards.judge.batch_size": 16, "rewards.judge_unparsable_score": -0.25,
        "rewards.judge.criteria": ({"name": "correct", "weight": 1.0, "description": "the sum is right"},)}),
        progress=False)
    assert summary["end_step"] == 2
    rows = [r for r in archive.read(run).to_pylist() if r["in_batch"]]
    assert len(rows) == 32
    model_rewards = []
    for r in rows:
        d = json.loads(r["details"])
        want = (weights["env"] * d["env_reward"] + weights["model"] * d["model_reward"]
                + weights["judge"] * d["judge"]["score"])
        assert r["reward"] == pytest.approx(want, abs=1e-5)
        assert d["judge"]["parsed"] is False and d["judge"]["score"] == -0.25 and "output" in d["judge"]
        model_rewards.append(d["model_reward"])
    assert np.ptp(model_rewards) > 0  # the reward model tells replies apart
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "policy/loss" in m]
    assert len(trained) == 2 and all(m["reward/judge_unparsable_rate"] == 1.0 for m in trained)
    assert all({"reward/model_mean", "reward/env_mean", "perf/model_reward_s", "perf/judge_reward_s"} <= set(m)
               for m in trained)
