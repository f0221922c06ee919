"""--config.* overrides of keys that are not Python identifiers (issue 23: reasoning-gym domain names such as
``reasoning_gym/chain_sum`` under env.train, fnmatch patterns under tasks.policies): set from the command line
through `posttrain.cli.main`, a mistyped one stops with one line naming it. The command is stubbed: nothing runs."""
import sys

import pytest

from posttrain import cli
from posttrain.cli.flags import config_override_argv
from posttrain.config import from_config_dict

CONFIG = '''
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"
    c.env.train = {"reasoning_gym/chain_sum": env_spec("posttrain/Arithmetic-v0", digits=1),
                   "arithmetic": env_spec("posttrain/Arithmetic-v0", digits=2)}
    c.tasks.policies = {"reasoning_gym/*": {"min_share": 0.05}}
    return c
'''


@pytest.mark.parametrize("arg,expected", [
    ("--config.env.train.reasoning_gym/chain_sum.weight=2", "--config.env.train['reasoning_gym/chain_sum'].weight=2"),
    ("--config.tasks.policies.reasoning_gym/*.min_share=0.1",
     "--config.tasks.policies['reasoning_gym/*'].min_share=0.1"),
    ("--config.env.train['a.b'].weight=2", "--config.env.train['a.b'].weight=2"),  # written out: unchanged
    ("--config.rl.group_size=4", "--config.rl.group_size=4"),
    ("--workdir=runs/a/b", "--workdir=runs/a/b"),
    ("--noconfig.env.train.x/y.flag", "--noconfig.env.train['x/y'].flag"),
])
def test_override_paths_with_non_identifier_keys_are_subscripted(arg, expected):
    assert config_override_argv(["posttrain", arg]) == ["posttrain", expected]


@pytest.fixture
def run_train(tmp_path, monkeypatch):
    """main(["posttrain", "train", --config=<a config with domain keys>, *overrides]) with the train command
    stubbed: returns (exit code, the converted Config or None)."""
    path = tmp_path / "domains_config.py"
    path.write_text(CONFIG)
    seen = {}

    def train(f):
        seen["cfg"] = from_config_dict(f.config)
        return 0
    monkeypatch.setitem(cli.COMMANDS, "train", train)

    def run(*overrides):
        argv = ["posttrain", "train", f"--config={path}", *overrides]
        monkeypatch.setattr(sys, "argv", list(argv))  # as the console script leaves it
        return cli.main(argv), seen.get("cfg")
    return run


def test_domain_keys_are_settable_from_the_command_line(run_train):
    code, cfg = run_train("--config.env.train.reasoning_gym/chain_sum.kwargs.digits=3",
                          "--config.env.train.reasoning_gym/chain_sum.weight=2.5",
                          "--config.tasks.policies.reasoning_gym/*.min_share=0.1",
                          "--config.env.train.arithmetic.kwargs.digits=1")
    assert code == 0
    assert cfg.env.train["reasoning_gym/chain_sum"].kwargs["digits"] == 3
    assert cfg.env.train["reasoning_gym/chain_sum"].weight == 2.5
    assert cfg.env.train["arithmetic"].kwargs["digits"] == 1
    assert dict(cfg.tasks.policies["reasoning_gym/*"]) == {"min_share": 0.1}
    assert sys.argv[3].startswith("--config.env.train.reasoning_gym/")  # the caller's argv is left as it was


@pytest.mark.parametrize("override,named", [
    ("--config.env.train.reasoning_gym/chain_sun.weight=2", "env.train.reasoning_gym/chain_sun.weight"),
    ("--config.env.train.reasoning_gym/chain_sum.kwargs.digts=2", 'Did you mean "digits"'),
])
def test_a_mistyped_domain_key_is_one_line_exit_2(run_train, override, named, capsys):
    code, cfg = run_train(override)
    err = capsys.readouterr().err.strip()
    assert code == 2 and cfg is None
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and named in err, err
