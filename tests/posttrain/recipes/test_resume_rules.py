"""Resume rules: what a resume may change without --allow_config_change (train.steps, max_train_seconds) is still
recorded in config_changes.jsonl, a changed schedule setting warns with the rates it changes, and anything else is
refused unless allowed."""
import json
import logging

import pytest

from helpers import tiny_config
from posttrain.config import ConfigError
from posttrain.config.plan import make_run_plan
from posttrain.recipes import grpo
from posttrain.runs import lookup, workdir as workdir_lib


@pytest.fixture
def saved_run(tmp_path, monkeypatch):
    """A run directory whose config.json is a 4-step cosine run at checkpoint 4 (the checkpoint itself faked)."""
    plan = make_run_plan(tiny_config(tmp_path, **{"train.steps": 4, "optim.schedule": "cosine", "optim.lr": 3e-5,
                                                  "optim.min_lr_ratio": 0.1}))
    workdir_lib.write_config(tmp_path, plan.config_dict)
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr(lookup, "latest_checkpoint", lambda workdir: 4)
    return tmp_path


def resumed(workdir, **over):
    base = {"train.steps": 4, "optim.schedule": "cosine", "optim.lr": 3e-5, "optim.min_lr_ratio": 0.1}
    return make_run_plan(tiny_config(workdir, **{**base, **over}))


@pytest.mark.parametrize("key,value", [("train.steps", 6), ("train.max_train_seconds", 60.0)])
def test_a_free_setting_changes_without_a_flag_and_is_recorded(saved_run, key, value, caplog):
    plan = resumed(saved_run, **{key: value})
    changes = grpo.resume_changes(plan)
    assert list(changes) == [key] and changes[key][1:] == [value, 4]
    with caplog.at_level(logging.WARNING):
        grpo.record_settings(plan, changes)
    line = json.loads((saved_run / "config_changes.jsonl").read_text().splitlines()[-1])
    assert line["step"] == 4 and list(line["changes"]) == [key] and line["changes"][key][1] == value
    assert ("learning-rate schedule is recomputed" in caplog.text) == (key == "train.steps")


def test_changing_steps_warns_with_the_next_updates_rate_under_both_schedules(saved_run):
    plan = resumed(saved_run, **{"train.steps": 6})
    text = grpo.schedule_effect(plan, grpo.resume_changes(plan), 4)
    # cosine from 3e-5 to 3e-6 at update index 4: of 6 steps 3e-5 * (0.1 + 0.45 * (1 + cos(4/6 pi))) = 9.75e-6;
    # of 4 steps (the schedule's end) 3e-6
    assert "train.steps changed on resume" in text and "lr 9.75e-06 (3e-06 under the saved settings)" in text
    assert grpo.schedule_effect(plan, {}, 4) is None


@pytest.mark.parametrize("key,value", [("optim.lr", 1e-4), ("rl.group_size", 2), ("optim.warmup_steps", 1)])
def test_other_settings_are_refused_unless_allowed(saved_run, key, value):
    plan = resumed(saved_run, **{key: value})
    with pytest.raises(ConfigError, match=rf"changed settings: {key}"):
        grpo.resume_changes(plan)
    assert key in grpo.resume_changes(plan, allow=True)


def test_the_workdir_itself_is_not_a_change(saved_run, tmp_path_factory):
    plan = resumed(saved_run)
    assert grpo.resume_changes(plan) == {}


@pytest.mark.parametrize("restored,kept", [(4, [(0, 2), (2, 4)]), (2, [(0, 2)]), (3, [(0, 2), (2, 3)]), (0, None)])
def test_a_resume_carries_the_segments_before_its_step_and_the_start_evaluation(tmp_path, restored, kept):
    """summary.json of a run that went 0 -> 2, then 2 -> 4: a resume from step 4 keeps both segments, from 2 the
    first, from 3 the second cut at 3 (its later steps are trained again); a run starting over keeps nothing."""
    (tmp_path / "summary.json").write_text(json.dumps({
        "start_step": 2, "end_step": 4, "eval_start": {"eval/pass@1": 0.25},
        "segments": [{"start_step": 0, "end_step": 2, "train_wall_s": 5.0},
                     {"start_step": 2, "end_step": 4, "train_wall_s": 6.0}]}))
    carried = grpo.carried_summary(tmp_path, restored)
    if kept is None:
        assert carried == {}
        return
    assert [(s["start_step"], s["end_step"]) for s in carried["segments"]] == kept
    assert carried["eval_start"] == {"eval/pass@1": 0.25}
