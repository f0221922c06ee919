"""`configs/tiny.py` for 3 steps reproduces the run recorded before the phase-package move, exactly: every
non-timing metric of metrics.jsonl and the bytes of every array of the final checkpoint (tests/golden/). The loop
runs through the rollout queue at its default rollout.max_staleness=0 (issue 24 acceptance 1, weighted draw and
the dense sampler it was recorded with, `sampling.backend="dense"`: the rollout engine, the default on one device,
adds its own metrics; tests/posttrain/generate/test_backend.py checks it against the dense sampler, and
tests/posttrain/rollout/test_attempts.py holds the job scheduler's golden run)."""
import importlib.util
import json
import pathlib

from helpers import assert_equals_golden, golden_view
from posttrain.config import from_config_dict
from posttrain.recipes import grpo
from posttrain.config.plan import make_run_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]
GOLDEN = json.loads((ROOT / "tests/golden/tiny_3_steps.json").read_text())


def _config():
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "configs/tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.sampling.backend = "dense"
    return from_config_dict(c)


def test_tiny_three_steps_reproduce_the_recorded_run(tmp_path):
    plan = make_run_plan(_config(), workdir=str(tmp_path))
    assert plan.config.rollout.max_staleness == 0 and plan.step.loss.tis_cap is None  # the defaults: synchronous, no TIS
    grpo.train(plan, progress=False)
    view = golden_view(tmp_path)
    assert view["final_step"] == GOLDEN["final_step"] == 3
    assert_equals_golden(view, GOLDEN)
