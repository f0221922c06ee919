"""`runs.read` without a checkpoint (the commands that read a run end to end: tests/posttrain/
test_cli_run_kinds.py): an SFT / DPO run has no env of its own, so plain `eval` needs --config's, while a suite
evaluation, which builds only the suite's envs, takes the defaults."""
import importlib.util
import json
import pathlib

import pytest

from posttrain.config import ConfigError
from posttrain.runs import read as read_run
from posttrain.recipes import evaluate
from posttrain.config.plan import make_run_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _config(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_suite_evaluation_of_an_offline_run_needs_no_env_of_it(tmp_path, kind):
    from posttrain.config import dpo, sft

    load, dump = {"sft": (sft.sft_config_from_dict, sft.to_dict), "dpo": (dpo.dpo_config_from_dict, dpo.to_dict)}[kind]
    own = dump(load(_config(f"{kind}_tiny")))
    (tmp_path / "config.json").write_text(json.dumps(own))
    with pytest.raises(ConfigError, match=r"needs an env to evaluate on: pass --config=configs/X.py .*, or --suite$"):
        evaluate.reading_config(tmp_path)  # plain eval: the run's own env is what it evaluates
    cfg = evaluate.reading_config(tmp_path, None, "eval --suite", suite=True)
    assert {n: s.id for n, s in cfg.env.train.items()} == {"suite_placeholder": "posttrain/Arithmetic-v0"}
    assert cfg.env.eval == {} and cfg.train.workdir == str(tmp_path)
    assert cfg.model.preset == own["model"]["preset"] == "tiny-dense" and dict(cfg.model.overrides) == {
        "vocab_size": 320}  # the run's own model sections
    assert make_run_plan(cfg).workdir == tmp_path  # a valid plan; `grpo.build(reading=True, held_out=False)` builds
    # none of its envs (tests/posttrain/recipes/test_evaluate.py: a run whose env module is not importable)
