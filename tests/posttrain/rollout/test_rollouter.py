"""The rollouter: dynamic sampling redraws zero-variance groups and reports them; the curriculum moves env specs and
task sources (the end-to-end rollouts are exercised by test_grpo_loop.py and test_distributed.py)."""
import functools
import types

import pytest

from posttrain.rollout import env_side, rollouter
from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.config.plan import make_run_plan
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

    monkeypatch.setattr(rollouter.episodes, "run_episodes", fake_run_episodes)
    cfg = tiny_config("/tmp/x", **{"rl.dynamic_sampling": True, "rl.group_size": 2, "rl.prompts_per_step": 4})
    r = rollouter.Rollouter(
        settings=make_run_plan(cfg).rollout_settings, mesh=None, graphdef=None, tokenizer=types.SimpleNamespace(pad_id=0),
        runner=None, scheduler=listed_draw(cfg.rl.group_size),
        train_specs=dict(cfg.env.train), advantage_fn=advantage_fn("grpo"))
    samples, perf, attempts = r.draw(0, None, jax.random.key(0))
    assert calls == [4, 2] and len(samples) == 8
    assert len(attempts) == 12 and sum(a.in_batch for a in attempts) == 8  # the 2 set-aside groups: archived only
    assert perf["rollout/frac_groups_filtered"] == 2 / 6 and perf["rollout/groups_drawn"] == 6


def listed_draw(group_size: int):
    """A weighted draw whose k-th call of a step lists tasks 0..n-1 of "arithmetic" (pass 0)."""
    from posttrain.scheduling.weighted_draw import WeightedDraw

    source = types.SimpleNamespace(num_tasks=100, get_task=lambda i: {"id": i})
    draw = WeightedDraw({"arithmetic": source}, {"arithmetic": 1.0}, group_size=group_size)
    draw.next_draws = lambda key, n: [("arithmetic", i, 0, {"id": i}) for i in range(n)]
    return draw


def test_advance_curriculum_moves_specs_and_task_sources():
    """A failing step moves chain_sum from level 2 to 1: its env spec and task source follow, weights stay valid."""
    import types

    from posttrain.config import EnvSpec
    from posttrain.scheduling.curriculum import CurriculumConfig, from_env_specs
    from posttrain.rollout.episodes import Sample
    from posttrain.scheduling.weighted_draw import WeightedDraw

    spec = EnvSpec(id="posttrain/ReasoningGym-v0", weight=1.0,
                   kwargs={"dataset": "chain_sum", "config": "{}", "level": 2, "size": 50, "split": "train"})
    specs = {"chain": spec}
    cur = from_env_specs(specs, CurriculumConfig(enabled=True, window=8, min_episodes=8))
    source = env_side.task_sources(specs)["chain"][2]
    scheduler = WeightedDraw({"chain": source}, {"chain": 1.0})
    run = types.SimpleNamespace(curriculum=cur, train_specs=dict(specs), scheduler=scheduler)
    advance = functools.partial(rollouter.Rollouter.advance_curriculum, run)
    m = advance([Sample(domain="chain", group=0, prompt_ids=[], reward=0.0, status="ok")] * 8)
    assert m["curriculum/chain/level"] == 1.0 and run.train_specs["chain"].kwargs["level"] == 1
    assert scheduler.sources["chain"] is not source and scheduler.sources["chain"].num_tasks == source.num_tasks
    assert scheduler.sources["chain"].get_task(0) != source.get_task(0)  # the level-1 task differs
    m = advance([Sample(domain="chain", group=0, prompt_ids=[], reward=0.0, status="infra_error")] * 8)
    assert m["curriculum/chain/level"] == 1.0  # infra errors are not failures


# kind: a rollout whose envs fail stops the run with the first worker error, never trains on empty prompts
@pytest.mark.parametrize("statuses,limit,raised", [
    (["ok"] * 8, 0.5, False),
    (["infra_error"] * 8, 0.5, True),  # every episode failed (an env the workers could not build)
    (["infra_error"] * 4 + ["ok"] * 4, 0.5, False),  # half: at the limit, not over it
    (["infra_error"] * 5 + ["wrong"] * 3, 0.5, True),
    (["infra_error"] * 1 + ["ok"] * 7, 0.0, True),  # a zero limit stops at the first one
    (["infra_error"] * 8, 1.0, False),  # 1: never stop
])
def test_a_step_over_the_infra_error_limit_stops_with_the_first_worker_error(monkeypatch, statuses, limit, raised):
    import types

    import jax

    from posttrain.rollout.episodes import Sample

    def fake_run_episodes(sample_fn, tok, runner, episodes, group_size, **kw):
        return [Sample(domain="arithmetic", group=i // 2, prompt_ids=[1], reward=0.0, status=st,
                       info={"reason": f"reset raised NameNotFound: Environment `Mine` doesn't exist ({i})\ntrace"}
                       if st == "infra_error" else {}) for i, st in enumerate(statuses)], {}

    monkeypatch.setattr(rollouter.episodes, "run_episodes", fake_run_episodes)
    cfg = tiny_config("/tmp/x", **{"rl.group_size": 2, "rl.prompts_per_step": 4, "env.max_infra_error_rate": limit})
    r = rollouter.Rollouter(
        settings=make_run_plan(cfg).rollout_settings, mesh=None, graphdef=None, tokenizer=types.SimpleNamespace(pad_id=0),
        runner=None, scheduler=listed_draw(cfg.rl.group_size),
        train_specs=dict(cfg.env.train), advantage_fn=advantage_fn("grpo"))
    if not raised:
        assert len(r.draw(7, None, jax.random.key(0))[0]) == 8
        return
    with pytest.raises(env_side.EnvInfraError) as info:
        r.draw(7, None, jax.random.key(0))
    bad = statuses.count("infra_error")
    assert str(info.value) == (f"step 7: {bad} of 8 episodes ended in infra errors (more than "
                               f"env.max_infra_error_rate={limit:g}); the first (arithmetic): reset raised "
                               "NameNotFound: Environment `Mine` doesn't exist (0)")


def test_an_env_registered_only_in_this_process_fails_at_start_with_workers(tmp_path):
    """A custom env registered with gymnasium.register in the config file (this process only) and env.num_workers=2:
    the plan's dry check starts a worker, which cannot build it: one ConfigError naming the id and the
    `module:Env-v0` form, before any model load (it used to run with every episode an infra error)."""
    import gymnasium

    from envs import base
    from posttrain.config import ConfigError, to_dict, from_config_dict
    from posttrain.config import plan as run_plan

    class Mine(base.TextEnv):
        def __init__(self):
            super().__init__(base.ListTaskSource([{"id": "0", "q": "say 1"}], split="train"), self_check=False)

        def first_observation(self, task):
            return task["q"]

        def turn_step(self, action):
            return "", float(action.strip() == "1"), True, {"status": "ok"}

    if "test/MainOnly-v0" not in gymnasium.registry:
        gymnasium.register("test/MainOnly-v0", entry_point=Mine)
    raw = to_dict(tiny_config(tmp_path))
    raw["env"].update(train={"mine": {"id": "test/MainOnly-v0", "weight": 1.0, "kwargs": {}}}, eval={},
                      num_workers=2)
    plan = make_run_plan(from_config_dict(raw))
    with pytest.raises(ConfigError) as info:
        run_plan.check_envs(plan)
    msg = str(info.value)
    assert msg.startswith("env.train.mine: id='test/MainOnly-v0' cannot be built in an env worker "
                          "(env.num_workers=2): reset raised NamespaceNotFound: Namespace test not found"), msg
    assert "'my.module:MyEnv-v0'" in msg and "'<module>:test/MainOnly-v0'" in msg and "\n" not in msg


def test_the_cli_prints_an_infra_error_stop_in_one_line_with_exit_code_1(monkeypatch, capsys):
    from posttrain import cli

    def failing(f):
        raise env_side.EnvInfraError("step 0: 16 of 16 episodes ended in infra errors (more than "
                                      "env.max_infra_error_rate=0.5); the first (mine): reset raised NameNotFound")

    monkeypatch.setitem(cli.COMMANDS, "train", failing)
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    assert cli.main(["posttrain", "train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step 0: 16 of 16 episodes ended in infra errors")


def test_a_reading_rollouter_builds_no_training_env_and_draws_nothing():
    """`Rollouter.create(train=False)` (a command that only reads a run: suite evaluation, sample, convert) builds
    none of settings.train_specs (here a module that is not importable) and refuses what needs the scheduler; a
    training rollouter builds them and names the one that fails. The runner carries env.max_abs_reward."""
    import dataclasses

    from posttrain.config import EnvSpec
    from posttrain.model.tokenizer import Tokenizer

    specs = {"words": EnvSpec(id="no_such_envs_module:WordLength-v0")}
    st = make_run_plan(tiny_config("/tmp/x", **{"env.max_abs_reward": 3.0})).rollout_settings
    settings = dataclasses.replace(st, env_config=dataclasses.replace(st.env_config, train=specs),
                                   engine=None)  # the dense sampler: no mesh needed
    r = rollouter.Rollouter.create(settings, None, None, Tokenizer.byte_level(), advantage_fn("grpo"), train=False)
    try:
        assert r.scheduler is None and r.train_specs == {} and r.curriculum is None
        assert r.runner.max_abs_reward == 3.0 and settings.env_config.max_abs_reward == 3.0
        for what, call in (("draw training tasks", lambda: r.draw(0, None, None)), ("save", r.state_dict),
                           ("report", lambda: r.status(0))):
            with pytest.raises(RuntimeError, match=f"built to read a run .*: it has no task scheduler to {what}$"):
                call()
    finally:
        r.close()
    with pytest.raises(env_side.EnvSpecError, match=r"^words: id='no_such_envs_module:WordLength-v0' kwargs=\{\}: "
                                                    r"ModuleNotFoundError: No module named 'no_such_envs_module'"):
        rollouter.Rollouter.create(settings, None, None, Tokenizer.byte_level(), advantage_fn("grpo"))
