"""Training faults the loop must survive or stop on cleanly: non-finite steps are skipped, logged and counted,
and a run of them stops with a checkpoint; dynamic-sampling and truncated-sampling reporting."""
import functools
import json
import pathlib

import pytest

from posttrain import loop, rollouter
from posttrain.run_plan import make_run_plan, truncation_warning
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import from_config_dict
from helpers import tiny_config


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

    monkeypatch.setattr(rollouter.rollout, "run_episodes", fake_run_episodes)
    cfg = tiny_config("/tmp/x", **{"rl.dynamic_sampling": True, "rl.group_size": 2, "rl.prompts_per_step": 4})
    r = rollouter.Rollouter(
        plan=make_run_plan(cfg), mesh=None, graphdef=None, tokenizer=types.SimpleNamespace(pad_id=0), runner=None,
        scheduler=types.SimpleNamespace(next_tasks=lambda seed, n: [("arith", {"id": i}) for i in range(n)]),
        train_specs=dict(cfg.env.train), eval_episodes={})
    samples, perf = r.draw(0, None, jax.random.key(0))
    assert calls == [4, 2] and len(samples) == 8
    assert perf["rollout/frac_groups_filtered"] == 2 / 6 and perf["rollout/groups_drawn"] == 6


def test_truncated_sampling_warns():
    assert make_run_plan(tiny_config("/tmp/x")).warnings == ()
    (warning,) = make_run_plan(tiny_config("/tmp/x", **{"sampling.top_p": 0.9})).warnings
    assert "top_p=0.9" in warning
    assert "top_k=20" in truncation_warning(tiny_config("/tmp/x", **{"sampling.top_k": 20}))


def test_advance_curriculum_moves_specs_and_task_sources():
    """A failing step moves chain_sum from level 2 to 1: its env spec and task source follow, weights stay valid."""
    import types

    from posttrain.config import EnvSpec
    from posttrain.curriculum import CurriculumConfig, from_env_specs
    from posttrain.rollout import Sample
    from posttrain.scheduler import TaskScheduler

    spec = EnvSpec(id="posttrain/ReasoningGym-v0", weight=1.0,
                   kwargs={"dataset": "chain_sum", "config": "{}", "level": 2, "size": 50, "split": "train"})
    specs = {"chain": spec}
    cur = from_env_specs(specs, CurriculumConfig(enabled=True, window=8, min_episodes=8))
    source = rollouter.task_sources(specs)["chain"][2]
    scheduler = TaskScheduler({"chain": source}, {"chain": 1.0})
    run = types.SimpleNamespace(curriculum=cur, train_specs=dict(specs), scheduler=scheduler)
    advance = functools.partial(rollouter.Rollouter.advance_curriculum, run)
    m = advance([Sample(domain="chain", group=0, prompt_ids=[], reward=0.0, status="ok")] * 8)
    assert m["curriculum/chain/level"] == 1.0 and run.train_specs["chain"].kwargs["level"] == 1
    assert scheduler.sources["chain"] is not source and scheduler.sources["chain"].num_tasks == source.num_tasks
    assert scheduler.sources["chain"].get_task(0) != source.get_task(0)  # the level-1 task differs
    m = advance([Sample(domain="chain", group=0, prompt_ids=[], reward=0.0, status="infra_error")] * 8)
    assert m["curriculum/chain/level"] == 1.0  # infra errors are not failures


@pytest.mark.slow  # ~1-2 min: several sampler compiles as prompts change with the level
def test_curriculum_moves_levels_in_the_loop_and_resumes(tmp_path):
    """chain_sum starts at level 2; a random tiny model passes nothing, so with window = min_episodes = 16 (one
    step's episodes) the level falls one step per step, the env specs follow, and a resumed run keeps it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reasoning_tiny", pathlib.Path(__file__).resolve().parents[2]
                                                  / "configs" / "reasoning_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    chain = c.env.train["reasoning_gym/chain_sum"]
    chain.kwargs.level = 2
    c.env.train = {"reasoning_gym/chain_sum": chain}
    c.env.eval = {}
    c.eval.at_start = c.eval.at_end = False
    c.curriculum.enabled, c.curriculum.window, c.curriculum.min_episodes = True, 16, 16
    c.train.workdir, c.checkpoint.async_save, c.checkpoint.every_steps = str(tmp_path), False, 1
    c.sampling.max_new_tokens = 4
    for steps in (2, 3):
        c.train.steps = steps
        loop.train(from_config_dict(c), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    levels = [r["curriculum/reasoning_gym/chain_sum/level"] for r in rows if "curriculum/reasoning_gym/chain_sum/level" in r]
    moves = [r["curriculum/reasoning_gym/chain_sum/moves"] for r in rows if "curriculum/reasoning_gym/chain_sum/moves" in r]
    assert levels == [1.0, 0.0, 0.0] and moves == [1.0, 2.0, 2.0]  # step 3 ran after a resume: state restored
