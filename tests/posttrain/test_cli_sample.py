"""`posttrain sample --checkpoint=RUN --seed=N`: the run's newest checkpoint under its saved config.json, read
only; greedy replies do not depend on the seed, sampled ones do (the same seed: the same reply)."""

import jax
import jax.numpy as jnp
import pytest

from helpers import tiny_config
from posttrain import GRPOTrainer, cli
from posttrain.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def zeroed_run(tmp_path_factory):
    """A tiny run whose step-0 checkpoint holds all-zero weights: zero logits, so its greedy reply is token 0
    repeated (the random-init model its config describes replies otherwise) and sampling is uniform."""
    run = tmp_path_factory.mktemp("run")
    with GRPOTrainer.from_config(tiny_config(run)) as trainer:
        learner = trainer._loop.learner
        learner.state = learner.state.replace(params=jax.tree.map(jnp.zeros_like, learner.state.params))
        trainer.save()
    return run


def sample(capsys, *args) -> tuple[int, str]:
    code = cli.main(["posttrain", "sample", "--prompt=What is 1 + 2?", "--max_new_tokens=8", *args])
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


def tree(run) -> list:
    return sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())


def test_sample_reads_the_run_and_its_seed_picks_the_stream(zeroed_run, capsys):
    before = tree(zeroed_run)
    code, greedy = sample(capsys, f"--checkpoint={zeroed_run}")
    assert code == 0
    assert greedy.rstrip("\n") == Tokenizer.byte_level().decode([0] * 8)  # the checkpoint's policy, not the base
    assert sample(capsys, f"--checkpoint={zeroed_run}", "--seed=5") == (0, greedy)  # greedy: seed-free
    hot = [sample(capsys, f"--checkpoint={zeroed_run}", "--temperature=1.0", f"--seed={s}") for s in (1, 2, 1)]
    assert [c for c, _ in hot] == [0, 0, 0]
    assert hot[0][1] == hot[2][1] != hot[1][1]
    assert tree(zeroed_run) == before  # read only: nothing written, moved or created


@pytest.mark.parametrize("args, message", [
    (("--checkpoint={tmp}/nope",), "error: --checkpoint="),
    (("--checkpoint={run}", "--model=x.gguf"), "one of --model=PATH and --checkpoint=RUN"),
])
def test_sample_of_a_bad_run_is_one_line(zeroed_run, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, run=zeroed_run) for a in args]
    try:
        code, err = sample(capsys, *args)
    except SystemExit as e:  # main() leaves a command's own usage errors to the interpreter: one line
        code, err = 2, str(e)
    assert code == 2 and message in err and not (tmp_path / "nope").exists()


def test_sample_help_lists_checkpoint_and_seed(capsys):
    assert cli.main(["posttrain", "sample", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--checkpoint=" in text and "--seed=" in text and "--temperature=" in text
    assert "posttrain sample" in text
