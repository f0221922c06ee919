"""The README runs as written: every ```python block in a fresh process from the checkout root, every `posttrain
<command>` line of a ```bash block against that command's `--help` (its command, flags and --config.* keys exist),
and every repository path the README names exists.

A python block that cannot run quickly here carries the marker `# readme-test: skip <reason>` (the reason is
required and shown as the skip reason); none does today. The blocks share the suite's XLA compilation cache
(tests/conftest.py), so a block that compiles what an earlier test compiled loads it instead.
"""
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from posttrain import cli
from posttrain.recipes.trainer import load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = (ROOT / "README.md").read_text()
SKIP_MARK = "# readme-test: skip"
BLOCK_TIMEOUT_S = 240  # the 2-core CPU under a parallel suite; a block takes 1-30 s alone


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", TEXT, re.S | re.M)


def posttrain_lines() -> list[str]:
    return [line.strip() for block in blocks("bash") for line in block.splitlines()
            if line.strip().startswith("posttrain ")]


def block_id(code: str) -> str:
    first = next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from")))
    return first.strip()[:40]


PYTHON = blocks("python")


@pytest.mark.parametrize("code", PYTHON, ids=[block_id(c) for c in PYTHON])
def test_every_python_block_runs_in_a_fresh_process(code):
    if SKIP_MARK in code:
        reason = code.split(SKIP_MARK, 1)[1].splitlines()[0].strip(" :()")
        assert reason, f"a {SKIP_MARK!r} marker must give its reason:\n{code}"
        pytest.skip(reason=reason)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, f"README block failed:\n{code}\n{r.stderr[-4000:]}"
    assert r.stdout.strip() or "print(" not in code, "the block printed nothing"


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(PYTHON) >= 3 and len(posttrain_lines()) >= 8
    assert any("GRPOTrainer" in c for c in PYTHON) and any("gymnasium.make" in c for c in PYTHON)


def _config_keys_exist(config_path: str | None, key: str) -> bool:
    """Whether --config.<key> names a key of the line's --config file (else of the GRPO default config)."""
    from posttrain.config import default_config

    node = load_config_file(ROOT / config_path) if config_path else default_config()
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True


def _flag_exists(name: str, listed: str, config_path: str | None = None) -> bool:
    """Whether --name is a flag `listed` by a command's help (--noX: the bool --X), or --config.<key> a key."""
    if name.startswith("config."):
        return "--config.<section>.<key>" in listed and _config_keys_exist(config_path, name.removeprefix("config."))
    return f"--{name}=" in listed or (name.startswith("no") and f"--{name[2:]}=" in listed)


@pytest.mark.parametrize("line", posttrain_lines())
def test_every_posttrain_line_names_a_command_and_flags_that_exist(line):
    _, command, *args = shlex.split(line, comments=True)
    assert command in cli.COMMANDS, f"{line}: no command {command!r} (commands: {cli.COMMANDS})"
    listed = cli.command_help(command, cli._flags())
    flags = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
    positional = [a for a in args if not a.startswith("--")]
    if command in cli.POSITIONAL:  # `tasks <verb> FILE...`: the verb is one the command knows
        assert positional and positional[0] in cli.tasks.VERBS, f"{line}: no verb among {cli.tasks.VERBS}"
    else:
        assert not positional, f"{line}: an argument that is not a --flag"
    for name, value in flags.items():
        assert _flag_exists(name, listed, flags.get("config")), f"{line}: `{command} --help` lists no --{name}"
        if value.startswith("configs/"):
            assert (ROOT / value.split(":")[0]).is_file(), f"{line}: no file {value}"


def prose_commands() -> list[str]:
    """The `posttrain <command> ...` spans of the README's prose (inline code, possibly over two lines)."""
    return [" ".join(m.split()) for m in re.findall(r"`(posttrain [^`]+)`", TEXT)]


@pytest.mark.parametrize("span", prose_commands())
def test_every_posttrain_command_in_the_prose_names_flags_that_exist(span):
    command = span.split()[1]
    assert command in cli.COMMANDS, f"`{span}`: no command {command!r}"
    listed = cli.command_help(command, cli._flags())
    for name in re.findall(r"--([a-z_][\w.]*)", span):
        assert _flag_exists(name, listed), f"`{span}`: `posttrain {command} --help` lists no --{name}"


PATH_RE = re.compile(r"(?:(?<=\./)|(?<![\w/.]))"  # a path from the checkout root, or after ./
                     r"((?:configs|scripts|bench|launch|colab|docs|posttrain|envs|tests)/[\w./-]*\w\."
                     r"(?:py|sh|ipynb|md|sbatch|toml))\b")


def test_every_repository_path_the_readme_names_exists():
    paths = sorted(set(PATH_RE.findall(TEXT)))
    assert len(paths) > 20 and "configs/tiny.py" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README names files that do not exist: {missing}"
