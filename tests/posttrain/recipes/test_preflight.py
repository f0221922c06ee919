"""The pre-flight memory check (`posttrain.recipes.plan.check`): machine names, the decision on a tiny model against
faked limits (fits / does not fit / skipped), the refusal before any load or write, and every shipped config
stating its machine; the slow case compiles each CPU config's step against the 24 GB machine."""
import importlib.util
import math
import pathlib

import jax
import pytest
from flax import nnx

from helpers import tiny_config
from posttrain.config import from_config_dict
from posttrain.model.transformer import Transformer
from posttrain.recipes import grpo
from posttrain.recipes import plan as plan_command
from posttrain.config.plan import make_run_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("configs/*.py"), *ROOT.glob("configs/plan/*.py")])
GB = 10**9


ARGS = {"task_file": ("tasks.jsonl",)}  # configs whose get_config needs the text after --config=FILE.py:


def load_config(rel: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(*ARGS.get(pathlib.Path(rel).stem, ()))


@pytest.mark.parametrize("name,expected", [
    ("cpu-1:24GB", plan_command.Machine("cpu-1", "cpu", 1, 24 * GB)),
    ("cpu-8", plan_command.Machine("cpu-8", "cpu", 8, None)),
    ("cpu-2:0.5GB", plan_command.Machine("cpu-2", "cpu", 2, GB // 2)),
    ("v5p-512", plan_command.Machine("v5p-512", "tpu", 512)),
    ("v6e-1", plan_command.Machine("v6e-1", "tpu", 1)),
    ("h200x256", plan_command.Machine("h200x256", "gpu", 256)),
])
def test_parse_machine(name, expected):
    assert plan_command.parse_machine(name) == expected


@pytest.mark.parametrize("name", ["", "cpu", "cpu-0", "cpu-1:24", "cpu-1:24GiB", "gpu-1", "v5p-", "h200-8", "a100x8"])
def test_parse_machine_refuses(name):
    with pytest.raises(ValueError, match=f"train.machine={name!r}: expected cpu-N"):
        plan_command.parse_machine(name)


@pytest.mark.parametrize("rel", CONFIGS)
def test_every_shipped_config_states_its_machine(rel):
    c = load_config(rel)
    machine = plan_command.parse_machine(c.train.machine)  # "" (the default: not stated) is refused
    if machine.platform == "cpu":  # a CPU config names the host memory it assumes: the 2-core 24 GB machine
        assert machine == plan_command.Machine("cpu-1", "cpu", 1, 24 * GB), rel


def tiny_plan(tmp_path, prompt_len=16):
    return make_run_plan(tiny_config(tmp_path / "run", **{"train.preflight_prompt_len": prompt_len}))


def test_decision_table_on_a_tiny_model(tmp_path, monkeypatch):
    plan = tiny_plan(tmp_path)
    report = plan_command.check(plan, limit=(10**12, "fake host"))  # fits
    compiled = {k: v for k, v in report.items() if k != "limit"}
    monkeypatch.setattr(plan_command, "compile_step", lambda *a: compiled)  # one compile: the same figures below
    peak = report["peak"]
    # 4 packed rows of 16 prompt + 4 x 6 completion tokens; the peak holds at least the parameters, their two
    # Adam moments and the new parameters (float32), and far less than the whole host
    assert (report["rows"], report["row_len"]) == (4, 48)
    params = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(lambda: nnx.state(Transformer(plan.policy.preset_config(), rngs=nnx.Rngs(0)), nnx.Param))))
    assert 4 * params < peak < 0.1 * 2**30
    assert plan_command.check(plan, limit=(int(peak / 0.9) + 1, "fake host"))["peak"] == peak  # exactly at 90%
    with pytest.raises(plan_command.PreflightError) as e:  # 1 byte under: refused, with the figures and the knobs
        plan_command.check(plan, limit=(int(peak / 0.9) - 2, "fake host"))
    line = str(e.value)
    assert f"needs {peak / 2**30:.1f} GiB" in line and "fake host" in line and "\n" not in line
    for knob in ("model.remat=dots or full (now none)", "rl.num_microbatches (now 1)",
                 "rl.prompts_per_step x rl.group_size (now 4 x 4)", "sampling.max_new_tokens (now 6)",
                 "train.preflight_prompt_len=0 skips"):
        assert knob in line
    assert plan_command.check(tiny_plan(tmp_path, 0), limit=(1, "fake host")) is None  # the switch: nothing compiled
    with pytest.raises(ValueError, match="train.preflight_prompt_len=-1"):
        plan_command.check(tiny_plan(tmp_path, -1))


def test_verdict_counts_every_cpu_device_of_the_host():
    class Plan:  # the fields `verdict` reads
        class config:
            class rl:
                prompts_per_step, group_size, packed = 8, 8, False

            class sampling:
                max_new_tokens = 256

        class step:
            num_microbatches = 1

    step = {"peak": 11 * 2**30, "rows": 64, "row_len": 896, "remat": "none"}
    assert plan_command.verdict(Plan, step, 24 * GB, "host", devices=1) is None
    line = plan_command.verdict(Plan, step, 24 * GB, "host", devices=2)  # 2 x 11 GiB > 0.9 x 22.35 GiB
    assert "needs 22.0 GiB" in line and "(2 devices x 11.0 GiB)" in line and "rl.packed=True (now False)" in line


def test_refused_before_the_model_loads_and_nothing_written(tmp_path, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(grpo, "load_policy", forbidden)
    monkeypatch.setattr(grpo, "check_envs", forbidden)  # no env built, no worker started
    monkeypatch.setattr(plan_command, "memory_limit", lambda devices: (10**6, "host memory available"))
    with pytest.raises(plan_command.PreflightError, match="over 90% of the 0.0 GiB host memory available"):
        grpo.train(tiny_plan(tmp_path), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # ~10-25 s per config on 2 cores; the decision itself is covered by test_decision_table_on_a_tiny_model
@pytest.mark.parametrize("rel", CONFIGS)
def test_every_cpu_config_fits_the_24gb_machine(rel):
    import dataclasses

    c = load_config(rel)
    if plan_command.parse_machine(c.train.machine).platform != "cpu" or "rl" not in c:
        pytest.skip(reason="not a GRPO config for a CPU machine")
    cfg = from_config_dict(c)
    plan = make_run_plan(cfg, workdir="/nonexistent")
    prompt_len = cfg.train.preflight_prompt_len or 128  # the tiny configs skip the check at start-up
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, preflight_prompt_len=prompt_len))
    plan = make_run_plan(cfg, workdir="/nonexistent")
    report = plan_command.check(plan, limit=(24 * GB, "the 24 GB machine"))
    print(f"{rel}: {report['peak'] / 2**30:.2f} GiB")
    assert report["peak"] <= 0.9 * 24 * GB
