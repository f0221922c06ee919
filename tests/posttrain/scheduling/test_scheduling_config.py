"""The config's `tasks` section becomes the job scheduler's own settings (`SchedulerSettings.of`), with one
ConfigError naming `tasks` for a bad policy, before any I/O."""
import pytest

from posttrain.config import ConfigError, default_config, env_spec, from_config_dict
from posttrain.scheduling.domain_rules import SchedulerSettings


def scheduler_settings(cfg, run):
    return SchedulerSettings.of(cfg.tasks, sorted(cfg.env.train), group_size=cfg.rl.group_size, seed=cfg.train.seed,
                                run=run.replace(":", "_"))
from posttrain.scheduling.domain_rules import DomainPolicy


def config(**tasks):
    c = default_config()
    c.env.train = {name: env_spec("posttrain/Arithmetic-v0") for name in ("rg/a", "rg/b", "code")}
    c.rl.group_size, c.train.seed = 4, 7
    for key, value in tasks.items():
        setattr(c.tasks, key, value)
    return from_config_dict(c)


def test_the_tasks_section_becomes_scheduler_settings():
    cfg = config(enabled=True, max_attempts=2, band_visits=3,
                 policies={"rg/*": {"min_share": 0.25}, "code": {"priority": 1, "max_concurrency": 8}})
    s = scheduler_settings(cfg, "runs:x")
    assert (s.group_size, s.seed, s.run, s.max_attempts, s.band_visits) == (4, 7, "runs_x", 2, 3)
    assert dict(s.policies) == {"code": DomainPolicy(priority=1, max_concurrency=8),
                                "rg/*": DomainPolicy(min_share=0.25)}
    assert config().tasks.enabled is False and scheduler_settings(config(), "r").policies == ()


def test_the_run_plan_hands_the_settings_to_the_rollout_phase_only_when_enabled():
    from posttrain.config.plan import make_run_plan

    on, off = (make_run_plan(config(enabled=e), num_devices=1, workdir="runs/x:y") for e in (True, False))
    assert on.rollout_settings.scheduler is on.scheduler and on.scheduler.run == on.rollout_settings.run == "x_y"
    assert off.rollout_settings.scheduler is off.scheduler is None and off.rollout_settings.run == "x_y"


@pytest.mark.parametrize("tasks, match", [
    ({"policies": {"rg/*": {"min_share": 0.6}}}, "tasks: min_share sums to 1.2"),
    ({"policies": {"code": {"min_share": 0.5, "max_share": 0.25}}}, r"tasks: tasks.policies\['code'\].*min_share"),
    ({"policies": {"code": {"prio": 1}}}, "unknown field"),
    ({"policies": {"web/*": {}}}, "matches no domain"),
    ({"breaker_rate": 0.0}, "tasks: scheduling options: needs 0 < breaker_rate"),
])
def test_bad_tasks_settings_raise_one_config_error(tasks, match):
    with pytest.raises(ConfigError, match=match):
        scheduler_settings(config(**tasks), "run")


def test_unknown_tasks_key_is_rejected_at_load():
    c = default_config()
    c.env.train = {"a": env_spec("posttrain/Arithmetic-v0")}
    c.tasks.unknown = 1
    with pytest.raises(ConfigError, match="tasks.unknown"):
        from_config_dict(c)
