"""The rollouter: dynamic sampling redraws zero-variance groups and reports them; the curriculum moves env specs and
task sources (the end-to-end rollouts are exercised by test_grpo_loop.py and test_distributed.py)."""
import functools

from posttrain.rollout import rollouter
from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.recipes.run_plan import make_run_plan
from helpers import tiny_config


def test_dynamic_sampling_reports_the_fraction_of_groups_filtered(monkeypatch):
    """Round 1 draws 4 groups (2 with equal rewards: set aside), round 2 draws the 2 missing: 2 of 6 filtered."""
    import types

    import jax

    from posttrain.rollout.episodes import Sample

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
        settings=make_run_plan(cfg).rollout, mesh=None, graphdef=None, tokenizer=types.SimpleNamespace(pad_id=0),
        runner=None, scheduler=types.SimpleNamespace(next_tasks=lambda seed, n: [("arithmetic", {"id": i}) for i in range(n)]),
        train_specs=dict(cfg.env.train), advantage_fn=advantage_fn("grpo"))
    samples, perf = r.draw(0, None, jax.random.key(0))
    assert calls == [4, 2] and len(samples) == 8
    assert perf["rollout/frac_groups_filtered"] == 2 / 6 and perf["rollout/groups_drawn"] == 6


def test_advance_curriculum_moves_specs_and_task_sources():
    """A failing step moves chain_sum from level 2 to 1: its env spec and task source follow, weights stay valid."""
    import types

    from posttrain.config import EnvSpec
    from posttrain.tasks.curriculum import CurriculumConfig, from_env_specs
    from posttrain.rollout.episodes import Sample
    from posttrain.tasks.scheduler import TaskScheduler

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
