"""Every configs/*.py loads into a valid frozen Config; bad keys and values raise one clear error."""
import dataclasses
import importlib.util
import pathlib

import pytest

from posttrain.config import Config, ConfigError, from_config_dict

CONFIGS = sorted(p for p in pathlib.Path(__file__).resolve().parents[3].joinpath("configs").glob("**/*.py")
                 if p.parent.name != "eval")  # configs/eval/*.py are evaluation suites (test_eval_suite)


ARGS = {"task_file": "tasks.jsonl"}  # configs whose get_config needs the text after --config=FILE.py:


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(ARGS[path.stem]) if path.stem in ARGS else module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_loads(path):
    if path.stem.startswith(("sft_", "dpo_", "rm_")):  # `posttrain sft` / `dpo` / `rm` configs: their own schemas
        from posttrain.config.dpo import dpo_config_from_dict
        from posttrain.config.rm import rm_config_from_dict
        from posttrain.config.sft import sft_config_from_dict

        loaders = {"sft": sft_config_from_dict, "dpo": dpo_config_from_dict, "rm": rm_config_from_dict}
        cfg = loaders[path.stem.split("_")[0]](load(path))
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.train = None
        return
    cfg = from_config_dict(load(path))
    assert isinstance(cfg, Config) and cfg.env.train
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl.group_size = 3


def test_config_files_exist():
    assert {"quickstart", "gsm8k", "humaneval", "tool", "tiny", "moe_tiny"} <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("section,key,value,match", [
    ("rl", "bogus", 1, r"unknown config key\(s\) \['rl.bogus'\]"),
    ("rl", "routing_replay", "always", r"rl.routing_replay='always'; expected one of"),
    ("model", "attention_impl", "flash", r"model.attention_impl='flash'; expected one of"),
    ("rl", "group_size", 0, r"rl.group_size=0 is out of range: must be >= 2"),
    ("rl", "group_size", 1, r"rl.group_size=1 is out of range: must be >= 2 \(a group of 1 is its own baseline"),
    ("rl", "eps_low", 1.5, r"rl.eps_low=1.5 is out of range: must be in \[0, 1\)"),
    ("sampling", "top_k", -2, r"sampling.top_k=-2 is out of range: must be >= 0"),
    ("mesh", "fsdp", 0, r"mesh.fsdp=0 is out of range: must be -1"),
    ("optim", "lr", "fast", r"optim.lr: expected float"),
    ("env", "train", {}, r"env.train is empty"),
    ("optim", "lr", float("inf"), r"optim.lr: expected a finite number, got inf"),  # passed every range check
    ("rl", "beta", float("inf"), r"rl.beta: expected a finite number, got inf"),
    ("sampling", "temperature", float("inf"), r"sampling.temperature: expected a finite number"),
    ("optim", "lr", float("nan"), r"optim.lr: expected a finite number, got nan"),
    ("rl", "tis_cap", 0.5, r"rl.tis_cap=0.5 is out of range: must be >= 1 \(a cap below 1 scales down"),
    ("env", "max_abs_reward", 0.0, r"^env.max_abs_reward=0.0 is out of range: must be > 0$"),
    ("env", "max_abs_reward", -5, r"^env.max_abs_reward=-5.0 is out of range: must be > 0$"),
    ("env", "max_abs_reward", float("inf"), r"^env.max_abs_reward: expected a finite number, got inf$"),
    ("env", "max_abs_reward", float("nan"), r"^env.max_abs_reward: expected a finite number, got nan$"),
    ("env", "max_abs_reward", "1e4", r"^env.max_abs_reward: expected float, got '1e4' \(str\)$"),
])
def test_bad_values_raise_one_clear_error(section, key, value, match):
    raw = load(pathlib.Path(CONFIGS[0]).with_name("quickstart.py")).to_dict()
    raw[section][key] = value  # a plain dict: ml_collections' own type checks would catch some earlier
    with pytest.raises(ConfigError, match=match):
        from_config_dict(raw)


def test_env_max_abs_reward_defaults_to_1e4_and_takes_a_positive_number():
    raw = load(pathlib.Path(CONFIGS[0]).with_name("quickstart.py")).to_dict()
    assert from_config_dict(raw).env.max_abs_reward == 1e4
    raw["env"]["max_abs_reward"] = 50  # an int is a float setting's value
    assert from_config_dict(raw).env.max_abs_reward == 50.0


def test_env_domains_keeps_matching_train_and_eval_envs():
    from posttrain.config import default_config, env_spec

    cd = default_config()
    names = ("reasoning_gym/gcd", "reasoning_gym/lcm", "reasoning_gym/leg_counting", "arith")
    cd.env.train = {n: env_spec("posttrain/Arithmetic-v0") for n in names}
    cd.env.eval = {n: env_spec("posttrain/Arithmetic-v0") for n in names}
    cd.env.domains = " reasoning_gym/l*, arith"  # what --config.env.domains='...' sets
    cfg = from_config_dict(cd)
    assert sorted(cfg.env.train) == sorted(cfg.env.eval) == ["arith", "reasoning_gym/lcm", "reasoning_gym/leg_counting"]
    assert sorted(from_config_dict(dataclasses.asdict(cfg)).env.train) == sorted(cfg.env.train)  # idempotent
    cd.env.domains = ""
    assert len(from_config_dict(cd).env.train) == 4
    for bad, match in (("reasoning_gym/x*", "pattern 'reasoning_gym/x\\*' matches no env.train name"),
                       (" , ", "no pattern")):
        cd.env.domains = bad
        with pytest.raises(ConfigError, match=match):
            from_config_dict(cd)


def test_env_startup_timeout_reaches_the_env_pool(monkeypatch):
    """A component knob: `env.startup_timeout_s` is a key of the default config, is range-checked, and is what
    the env runner's pool waits for a starting worker."""
    import envs.pool.processes
    from posttrain.rollout.env_side import env_runner

    cd = load(pathlib.Path(CONFIGS[0]).with_name("quickstart.py"))
    assert cd.env.startup_timeout_s == 120.0
    cd.env.num_workers, cd.env.startup_timeout_s = 1, 7  # what --config.env.startup_timeout_s=7 sets
    seen = {}
    monkeypatch.setattr(envs.pool.processes, "EnvPool", lambda **kw: seen.update(kw) or object())
    env_runner(from_config_dict(cd).env)
    assert seen["startup_timeout_s"] == 7.0 and seen["num_workers"] == 1
    cd.env.startup_timeout_s = 0.0
    with pytest.raises(ConfigError, match=r"^env.startup_timeout_s=0.0 is out of range: must be > 0$"):
        from_config_dict(cd)


def test_the_task_file_config_names_its_file_or_says_how():
    path = next(p for p in CONFIGS if p.stem == "task_file")
    cfg = from_config_dict(load(path))
    assert cfg.env.train["tasks"].kwargs == {"split": "train", "verifier": "exact", "path": "tasks.jsonl"}
    assert cfg.env.eval["tasks"].kwargs["split"] == "test"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match=r"--config=configs/task_file.py:PATH.jsonl"):
        module.get_config()
