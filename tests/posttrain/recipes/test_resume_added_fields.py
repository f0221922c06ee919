"""Resuming a run saved by an earlier version: a config field added since (absent from its config.json) is no
change while the resumed run keeps the field's default (the saved run ran with that default's behaviour)."""
import json

import pytest

from helpers import saved_run, tiny_config
from posttrain.recipes import grpo
from posttrain.config import plan as run_plan


# kind: a field added after a run was saved is not a change when the resumed run keeps its default
@pytest.mark.parametrize("dropped,over,changed", [
    ("env.backend", {}, {}),  # saved by a version without env.backend: the default ("process") is what it ran
    ("env.backend", {"env.backend": "ray", "env.num_workers": 2},
     {"env.backend": [None, "ray"], "env.num_workers": [0, 2]}),  # a new non-default value is a change
    ("rl.group_size", {}, {"rl.group_size": [None, 4]}),  # the tiny run's 4 is not the field's default (8)
])
def test_a_field_the_saved_config_lacks_is_a_change_only_off_its_default(tmp_path, dropped, over, changed):
    saved_run(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    section, key = dropped.split(".")
    del saved[section][key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    new = run_plan.make_run_plan(tiny_config(tmp_path, **over))
    assert grpo.resume_changes(new, allow=True) == {k: [*v, 2] for k, v in changed.items()}
