"""Training faults the loop must survive or stop on cleanly: non-finite steps are skipped, logged and counted,
and a run of them stops with a checkpoint; dynamic-sampling and truncated-sampling reporting."""
import json

import pytest

from posttrain import loop
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import default_config, env_spec, from_config_dict


def tiny_config(workdir, **over):
    c = default_config()
    c.model.preset = "tiny-dense"
    c.model.overrides = {"vocab_size": 320}
    c.env.train = {"arith": env_spec("posttrain/Arithmetic-v0", split="train", digits=1, num_test=20)}
    c.rl.group_size, c.rl.prompts_per_step = 4, 4
    c.sampling.max_new_tokens = 4
    c.eval.at_start = c.eval.at_end = False
    c.train.workdir = str(workdir)
    c.checkpoint.async_save = False
    for k, v in over.items():
        section, key = k.split(".")
        setattr(getattr(c, section), key, v)
    return from_config_dict(c)


def test_consecutive_nonfinite_steps_stop_the_run_with_a_checkpoint(tmp_path, caplog):
    """lr = 1e30 with weight decay blows the weights up at the first update (even with all-zero advantages); every
    later loss is NaN and is skipped."""
    cfg = tiny_config(tmp_path, **{"optim.lr": 1e30, "optim.weight_decay": 0.1, "train.steps": 10,
                                   "train.max_nonfinite_skips": 2, "checkpoint.every_steps": 100})
    with pytest.raises(loop.NonFiniteError, match=r"2 consecutive steps had a non-finite"):
        loop.train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r.get("policy/skipped_nonfinite") == 1.0]
    assert len(skipped) == 2 and skipped[-1] == rows[-1]["step"] < 10
    assert Checkpointer(tmp_path / "checkpoints", every_steps=1, keep=2, read_only=True).latest_step() == skipped[-1]
    assert sum("update skipped" in r.getMessage() for r in caplog.records) == 2


def test_dynamic_sampling_reports_the_fraction_of_groups_filtered(monkeypatch):
    """Round 1 draws 4 groups (2 with equal rewards: set aside), round 2 draws the 2 missing: 2 of 6 filtered."""
    import types

    import jax

    from posttrain.rollout import Sample

    rewards_by_round = [[[1, 0], [0, 0], [1, 1], [0, 1]], [[0, 1], [1, 0]]]
    calls = []

    def fake_run_episodes(sample_fn, tok, runner, episodes, group_size, **kw):
        groups = rewards_by_round[len(calls)]
        calls.append(len(episodes))
        assert len(episodes) == len(groups)
        return [Sample(domain="d", group=i, prompt_ids=[1], reward=float(r), status="ok")
                for i, g in enumerate(groups) for r in g], {}

    monkeypatch.setattr(loop.rollout, "run_episodes", fake_run_episodes)
    cfg = tiny_config("/tmp/x", **{"rl.dynamic_sampling": True, "rl.group_size": 2, "rl.prompts_per_step": 4})
    run = types.SimpleNamespace(
        cfg=cfg, state=types.SimpleNamespace(rng=jax.random.key(0)), train_specs=dict(cfg.env.train),
        tokenizer=types.SimpleNamespace(pad_id=0),  runner=None,
        scheduler=types.SimpleNamespace(next_tasks=lambda seed, n: [("arith", {"id": i}) for i in range(n)]))
    samples, perf = loop.collect(run, 0, None)
    assert calls == [4, 2] and len(samples) == 8
    assert perf["rollout/frac_groups_filtered"] == 2 / 6 and perf["rollout/groups_drawn"] == 6


def test_truncated_sampling_warns():
    assert loop.truncation_warning(tiny_config("/tmp/x")) is None
    assert "top_p=0.9" in loop.truncation_warning(tiny_config("/tmp/x", **{"sampling.top_p": 0.9}))
    assert "top_k=20" in loop.truncation_warning(tiny_config("/tmp/x", **{"sampling.top_k": 20}))
