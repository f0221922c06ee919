"""GRPOTrainer, the step-by-step API: N `step()` calls write what `train` with train.steps=N writes (metrics rows,
archive rows, checkpoints; timings aside), its life cycle (done, close, errors), and the plan it builds from a
config file, a run directory, a Config or a dict with overrides. N = 3: configs/tiny.py as test_golden_run trains it
(the same compiled programs, loaded from the suite's cache; the README's GRPOTrainer block runs them too)."""
import json
import pathlib

import pytest

from helpers import tiny_config
from posttrain import GRPOTrainer, train
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import ConfigError, to_dict
from posttrain.recipes import trainer as trainer_lib
from posttrain.runs.resources import Resources
from posttrain.scheduling import archive

ROOT = pathlib.Path(__file__).resolve().parents[3]


def rows(workdir) -> list[dict]:
    """metrics.jsonl rows without timings (perf/*)."""
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def archived(workdir) -> list[dict]:
    """The archive's rows, timings and the run's name (its workdir's) aside."""
    table = archive.read(workdir).drop_columns(["sampler_s", "env_s", "run"]).to_pylist()
    return [{**r, "episode_id": r["episode_id"].split(":", 1)[1]} for r in table]


def checkpoints(workdir) -> list[int]:
    with Checkpointer(pathlib.Path(workdir) / "checkpoints", every_steps=1, keep=9, read_only=True) as c:
        return c.all_steps()


def config(workdir):
    """configs/tiny.py (3 steps, its start- and end-of-run evaluation) with a synchronous checkpoint every step."""
    return trainer_lib.make_plan(ROOT / "configs" / "tiny.py", workdir=str(workdir), overrides={
        "checkpoint.every_steps": 1, "checkpoint.async_save": False})


def test_three_api_steps_write_what_three_train_steps_write(tmp_path):
    summary = train(config(tmp_path / "loop"), progress=False)
    with GRPOTrainer.from_config(config(tmp_path / "api")) as t:
        assert (t.global_step, t.done) == (0, False)
        assert "eval_start" in t.summary  # the start-of-run evaluation ran when the run opened
        got = [t.step(), t.step()]
        assert (t.global_step, t.done) == (2, False)
        got.append(t.step())
        assert (t.global_step, t.done) == (3, True)
        with pytest.raises(ValueError, match=r"train.steps=3 reached at step 3"):
            t.step()
        assert set(t.evaluate()) >= {"eval/pass@1"}
        assert t.save() == 3
    assert rows(tmp_path / "api") == rows(tmp_path / "loop")
    assert [r["step"] for r in rows(tmp_path / "api")] == [0, 1, 2, 3, 3]  # start eval, 3 updates, end eval
    assert [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in got] == \
        [{k: v for k, v in r.items() if k != "step"} for r in rows(tmp_path / "api")[1:4]]
    assert archived(tmp_path / "api") == archived(tmp_path / "loop")
    assert checkpoints(tmp_path / "api") == checkpoints(tmp_path / "loop") == [2, 3]  # checkpoint.keep=2
    saved = json.loads((tmp_path / "api" / "summary.json").read_text())
    assert (saved["start_step"], saved["end_step"], saved["eval_end"].keys()) == \
        (summary["start_step"], summary["end_step"], summary["eval_end"].keys())
    assert t.close() is t.summary  # a second close returns the summary again
    for call in (t.step, t.evaluate, t.save):
        with pytest.raises(RuntimeError, match="is closed"):
            call()


class _FakeLoop:
    def __init__(self):
        self.finished, self.summary = 0, {"start_step": 0}

    def finish(self):
        self.finished += 1
        return self.summary


def _fake_trainer(closed: list) -> GRPOTrainer:
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.plan = trainer_lib.make_plan(ROOT / "configs" / "tiny.py", workdir="unused")
    t._closed, t._timed_out, t._loop = False, False, _FakeLoop()
    t._res = Resources(("first", lambda: closed.append("first")), ("second", lambda: closed.append("second")))
    return t


@pytest.mark.parametrize("error, finished", [(None, 1), (KeyError("boom"), 0)])
def test_leaving_the_block_finishes_only_without_an_error(error, finished):
    closed = []
    t = _fake_trainer(closed)
    try:
        with t:
            if error is not None:
                raise error
    except KeyError:
        assert error is not None
    assert (t._loop.finished, closed, t._closed) == (finished, ["second", "first"], True)
    t.close()  # closed already: nothing runs twice
    assert (t._loop.finished, closed) == (finished, ["second", "first"])


def test_the_plan_from_a_file_a_run_directory_a_config_and_a_dict(tmp_path):
    tiny = ROOT / "configs" / "tiny.py"
    plan = trainer_lib.make_plan(tiny, workdir=str(tmp_path / "a"), overrides={"rl.group_size": 2,
                                                                                "train.steps": 5})
    assert (plan.config_dict["rl"]["group_size"], plan.config.train.steps, plan.workdir) == (2, 5, tmp_path / "a")
    (tmp_path / "steps.py").write_text("from posttrain.config.tiny import tiny_base\n\n\ndef get_config(steps):\n"
                                       "    c = tiny_base()\n    c.train.steps = int(steps)\n    return c\n")
    assert trainer_lib.make_plan(f"{tmp_path / 'steps.py'}:7").config.train.steps == 7  # FILE:ARG, as --config takes it
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(plan.config_dict, default=str))
    again = trainer_lib.make_plan(run)  # a run's directory: its saved settings, its own workdir
    assert (again.config_dict["rl"]["group_size"], again.workdir) == (2, run)
    cfg = tiny_config(tmp_path / "b")
    assert trainer_lib.make_plan(cfg, overrides={"optim.lr": 0.5}).config_dict["optim"]["lr"] == 0.5
    raw = to_dict(cfg)
    assert trainer_lib.make_plan(raw, overrides={"rl.group_size": 8}).config_dict["rl"]["group_size"] == 8
    assert raw["rl"]["group_size"] == 4  # the caller's dict is left alone
    assert trainer_lib.make_plan(plan) is plan


@pytest.mark.parametrize("source, kwargs, error, match", [
    ("configs/nope.py", {}, FileNotFoundError, "configs/nope.py"),
    ("configs/tiny.py", {"overrides": {"rl.nope": 1}}, ConfigError, "nope"),
    ("configs/tiny.py", {"overrides": {"nope.group_size": 1}}, ValueError, "'nope' is not a config section"),
    ("configs/tiny.py", {"overrides": {"rl.group_size": 1}}, ConfigError, "group_size"),
    ("plan", {"overrides": {"rl.group_size": 2}}, TypeError, "a RunPlan is final"),
])
def test_a_bad_source_or_override_is_one_clear_error(source, kwargs, error, match):
    if source == "plan":
        source = trainer_lib.make_plan(ROOT / "configs" / "tiny.py")
    elif isinstance(source, str):
        source = ROOT / source
    with pytest.raises(error, match=match):
        trainer_lib.make_plan(source, **kwargs)
