"""Every command that reads a run (eval, sample, convert, status) on every run kind posttrain writes (GRPO, SFT, DPO,
reward model; LoRA or full), in process: it reads the run's saved config.json and its newest checkpoint (all-zero
weights at step 3, so a reply from the checkpoint is token 0 repeated, never the random init), or refuses in one
line with exit code 2 naming why. The run folder is never changed. Kind: issue 29 items 1, 2 and 9."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from posttrain import GRPOTrainer, cli as cli_lib
from posttrain.model.tokenizer import Tokenizer

sys.path.insert(0, "configs")
import dpo_tiny, rm_tiny, sft_tiny  # noqa: E402,E401

ZERO_REPLY = Tokenizer.byte_level().decode([0] * 4)


def _zeroed(learner, step=3):
    learner.state = learner.state.replace(params=jax.tree.map(jnp.zeros_like, learner.state.params),
                                          step=jnp.asarray(step * learner.settings.updates_per_step,
                                                           learner.state.step.dtype))


def _offline_run(root, kind, lora):
    from posttrain.config.dpo import dpo_config_from_dict
    from posttrain.config.rm import rm_config_from_dict
    from posttrain.config.sft import sft_config_from_dict
    from posttrain.infra.partitioning import use_rules
    from posttrain.recipes import dpo, rm, sft

    module, load, recipe, make = {"sft": (sft_tiny, sft_config_from_dict, sft, sft.make_sft_plan),
                                  "dpo": (dpo_tiny, dpo_config_from_dict, dpo, dpo.make_dpo_plan),
                                  "rm": (rm_tiny, rm_config_from_dict, rm, rm.make_rm_plan)}[kind]
    c = module.get_config()
    c.lora.rank = 4 if lora else 0
    c.checkpoint.async_save = False
    plan = make(load(c), workdir=str(root))
    with use_rules(plan.rules):
        run = recipe.Run(plan)
        _zeroed(run.learner)
        run.learner.save({kind: {}}, force=True)
        run.learner.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{kind: run folder} for grpo, grpo_lora, sft, sft_lora, dpo and rm, each with a step-3 checkpoint of zeroed
    trainable weights (a LoRA run: its adapters)."""
    out = {}
    for name in ("grpo", "grpo_lora", "sft", "sft_lora", "dpo", "rm"):
        root = out[name] = tmp_path_factory.mktemp(name)
        if name.startswith("grpo"):
            with GRPOTrainer.from_config(tiny_config(root, **({"lora.rank": 4} if "lora" in name else {}))) as t:
                _zeroed(t._loop.learner)
                t.save()
        else:
            _offline_run(root, name.split("_")[0], "lora" in name)
    return out


def command(monkeypatch, capsys, *argv) -> tuple[int, str]:
    """`posttrain ARGV` in this process: (exit code, stdout or, on failure, the last stderr line). The --config.*
    override flags a --config defines are removed again for the next command."""
    from absl import flags

    argv = ["posttrain", *argv]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        code = cli_lib.main(list(argv))
    except SystemExit as e:  # a command's own usage error: one line
        code, err = 2, str(e)
        return code, err
    finally:
        for name in [n for n in flags.FLAGS if n.startswith("config.")]:
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    return code, out.out if code == 0 else (lines[-1] if lines else "")


def tree(run) -> list:
    return sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())


TINY_EVAL = ("--config=configs/tiny.py", "--config.eval.num_tasks=2")
# (kind, command args, exit code, what the output holds)
CASES = [(k, "eval", (), 0, '"step": 3') for k in ("grpo", "grpo_lora")]
CASES += [(k, "eval", (), 2, "needs an env to evaluate on: pass --config=") for k in ("sft", "dpo")]
CASES += [(k, "eval", TINY_EVAL, 0, '"step": 3') for k in ("grpo", "sft", "sft_lora", "dpo")]
CASES += [("rm", "eval", args, 2, "is a reward-model run (posttrain rm): eval evaluates a policy") for args in
          ((), TINY_EVAL)]
CASES += [(k, "sample", (), 0, ZERO_REPLY) for k in ("grpo", "grpo_lora", "sft", "sft_lora", "dpo")]
CASES += [("rm", "sample", (), 2, "sample generates replies; a reward model only scores them")]
CASES += [(k, "convert", (), 0, "ForCausalLM") for k in ("grpo", "grpo_lora", "sft", "sft_lora", "dpo")]
CASES += [("rm", "convert", (), 0, "ForSequenceClassification")]
CASES += [(k, "status", (), 2, f"is {a} {k.upper()} run (posttrain {k}): status shows a GRPO run's task scheduling")
          for k, a in (("sft", "an"), ("dpo", "a"))]
CASES += [("rm", "status", (), 2, "is a reward-model run (posttrain rm): status shows a GRPO run's task scheduling")]


@pytest.mark.parametrize("kind, cmd, args, code, expected", CASES,
                         ids=[f"{k}-{c}{'-config' if a else ''}" for k, c, a, _, _ in CASES])
def test_a_command_that_reads_a_run_reads_every_run_kind_or_refuses_in_one_line(runs, tmp_path, monkeypatch,
                                                                                 capsys, kind, cmd, args, code,
                                                                                 expected):
    run = runs[kind]
    before = tree(run)
    where = f"--workdir={run}" if cmd == "status" else f"--checkpoint={run}"
    extra = {"sample": ("--prompt=What is 1 + 2?", "--max_new_tokens=4"), "convert": (f"--out={tmp_path / 'hf'}",)}
    got, text = command(monkeypatch, capsys, cmd, where, *args, *extra.get(cmd, ()))
    assert got == code, text
    full = "lora" not in kind  # a LoRA run's zeroed adapters leave its base: only the full runs' replies are zeros
    if cmd == "sample" and code == 0:
        assert text.rstrip("\n") == expected or not full  # the checkpoint's zero weights, not the random init
    elif cmd == "convert":
        hf = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert hf["architectures"][0].endswith(expected), hf["architectures"]
        from safetensors.numpy import load_file

        tensors = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
        assert all(not np.any(t) for t in tensors.values()) or not full  # the checkpoint's weights
    else:
        assert expected in text and "\n" not in text.strip(), text
    assert tree(run) == before  # read only
