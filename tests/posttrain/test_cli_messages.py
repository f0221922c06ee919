"""Command-line mistakes get one line that names the fix: wrongly typed config values (in the file and on the
command line), overrides without a config file, unknown commands with the closest one."""
import pathlib
import sys

import pytest
from absl.testing import flagsaver

from posttrain import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = f"--config={ROOT}/configs/tiny.py"
CONFIG = """
from posttrain.config.tiny import tiny_base


def get_config():
    c = tiny_base()
    c.{key} = {value}
    return c
"""


def main(*args):
    with flagsaver.flagsaver():
        return cli.main(["posttrain", *args])


@pytest.mark.parametrize("key,value,message", [
    ("sampling.system_prompt", "5", "sets sampling.system_prompt = 5 (an int); that key holds a str (text)"),
    ("train.steps", "'ten'", "sets train.steps = ten (a str (text)); that key holds an int"),
    ("optim.lr", "'fast'", "sets optim.lr = fast (a str (text)); that key holds a float"),
    ("eval.at_start", "'yes'", "sets eval.at_start = yes (a str (text)); that key holds a bool"),
])
def test_a_wrongly_typed_value_in_a_config_file_names_the_key_value_and_type(tmp_path, capsys, key, value, message):
    path = tmp_path / "bad.py"
    path.write_text(CONFIG.format(key=key, value=value))
    assert main("train", f"--config={path}", f"--workdir={tmp_path}/w") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("flag,message", [
    ("--config.train.steps=abc", "--config.train.steps=abc: train.steps takes an int, got 'abc'"),
    ("--config.optim.lr=fast", "--config.optim.lr=fast: optim.lr takes a float, got 'fast'"),
    ("--config.eval.at_start=maybe", "eval.at_start takes a bool (True/False), got 'maybe'"),
])
def test_a_wrongly_typed_override_names_the_key_and_type(tmp_path, capsys, flag, message):
    assert main("train", TINY, flag, f"--workdir={tmp_path}/w") == 2
    assert message in capsys.readouterr().err


def test_a_text_key_keeps_the_text_typed(monkeypatch):
    """`--config.sampling.system_prompt=5` is the text "5" (the key holds text), not refused and not a number."""
    from posttrain.config import from_config_dict

    argv = ["posttrain", TINY, "--config.sampling.system_prompt=5"]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
    with flagsaver.flagsaver():
        f = cli._flags()
        f(argv)
        assert from_config_dict(f.config).sampling.system_prompt == "5"


@pytest.mark.parametrize("args", [("train", "--config.train.steps=4"), ("eval", "--config.eval.num_tasks=3"),
                                  ("train", "--workdir=x", "--config.rl.group_size=2")])
def test_an_override_without_a_config_file_says_to_give_one(capsys, args):
    assert main(*args) == 2
    err = capsys.readouterr().err
    assert "no --config=FILE.py is given: put --config=configs/<name>.py before it" in err


@pytest.mark.parametrize("command,close", [("trian", "train"), ("evl", "eval"), ("statsu", "status"), ("xyzzy", None)])
def test_an_unknown_command_is_named_with_the_closest_one(capsys, command, close):
    assert main(command) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: unknown command {command!r}")
    assert (f"did you mean {close!r}" in last) == (close is not None)
