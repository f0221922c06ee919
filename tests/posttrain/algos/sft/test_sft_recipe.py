"""`posttrain sft --config=configs/sft_tiny.py` in-process: 2 steps, their outputs, the training and held-out loss
going down on the memorisable dataset; config errors name the key before any work."""
import json
import os
import pathlib
import sys

import pytest

from posttrain import cli
from posttrain.config import ConfigError
from posttrain.config.sft import default_sft_config, sft_config_from_dict
from posttrain.recipes.sft import make_sft_plan

ROOT = pathlib.Path(__file__).resolve().parents[4]


CONFIG = ROOT / "configs" / "sft_tiny.py"


def run_sft(capsys, monkeypatch, *args) -> dict:
    """`posttrain sft --config=configs/sft_tiny.py ARGS` in this process; its JSON line."""
    rc, out, err = command(monkeypatch, capsys, "sft", f"--config={CONFIG}", *args)
    assert rc == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def command(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`posttrain ARGS --noprogress` in this process: (exit code, stdout, stderr). The --config.* override flags it
    defines (from sys.argv, as ml_collections does) are removed again, so another in-process command can define
    its own."""
    from absl import flags

    argv = ["posttrain", *args, "--noprogress"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        rc = cli.main(list(argv))
    finally:
        for name in [n for n in flags.FLAGS if n.startswith("config.")]:
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def losses(workdir) -> dict[int, float]:
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["sft/loss"] for r in lines if "sft/loss" in r}


def test_sft_command_runs_two_steps_and_the_loss_goes_down(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")  # no persistent compilation cache written from a test
    out = run_sft(capsys, monkeypatch, f"--workdir={tmp_path}", "--config.train.steps=2")
    assert out["start_step"] == 0 and out["end_step"] == 2
    assert 200 < out["eval_start"] < 1000  # held-out perplexity of a random init: about the vocabulary (320)
    assert out["eval_end"] < out["eval_start"] - 20
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["data"]["sft/examples"] == 16 and summary["data"]["sft/examples_eval"] == 4
    assert summary["eval_end"]["sft/eval_tokens"] > 0 and (tmp_path / "checkpoints").is_dir()
    loss = losses(tmp_path)
    assert sorted(loss) == [1, 2] and loss[2] < loss[1] - 0.1
    # the run is resumable with more steps, and nothing else: a changed setting, another recipe or an export into
    # it are one line, exit code 2, and leave its config.json as it was
    saved = (tmp_path / "config.json").read_text()
    for argv in (["sft", f"--config={CONFIG}", "--config.train.steps=3", "--config.optim.lr=0.5"],
                 ["dpo", f"--config={ROOT / 'configs' / 'dpo_tiny.py'}"],
                 ["convert", f"--checkpoint={tmp_path}"]):
        rc, _, err = command(monkeypatch, capsys, *argv, f"--{'out' if argv[0] == 'convert' else 'workdir'}={tmp_path}")
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert {"sft": "resuming", "dpo": "holds an SFT run", "convert": "is the run being exported"}[argv[0]] in err
    assert (tmp_path / "config.json").read_text() == saved
    assert run_sft(capsys, monkeypatch, f"--workdir={tmp_path}", "--config.train.steps=3")["end_step"] == 3


def test_bad_sft_configs_fail_before_any_work(tmp_path):
    c = default_sft_config()
    with pytest.raises(ConfigError, match="no training data"):
        sft_config_from_dict(c)
    c.sft.train_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"sft.train_path=.*missing.jsonl.*no such file"):
        sft_config_from_dict(c)
    c.sft.train_path = ""
    c.sft.train_examples = ({"prompt": "a", "completion": "b"},)
    c.sft.rows_per_step = 3
    c.sft.num_microbatches = 2
    with pytest.raises(ConfigError, match="sft.rows_per_step=3 does not divide into sft.num_microbatches=2"):
        make_sft_plan(sft_config_from_dict(c), num_devices=1)
    raw = c.to_dict()
    raw["sft"]["nonsense"] = 1
    with pytest.raises(ConfigError, match="sft.nonsense"):
        sft_config_from_dict(raw)
    c.optim.lr = -1.0  # a shared section: the run config's own rules
    with pytest.raises(ConfigError, match="optim.lr"):
        sft_config_from_dict(c)
    assert os.path.exists(ROOT / "configs" / "sft_tiny.py")
