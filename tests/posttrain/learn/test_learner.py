"""The learner: batch shardings from the RolloutBatch fields' dimension suffixes, one update under explicit in/out
shardings, a save / restore round trip of the train state with the rollouter's metadata, and the guard checkpoint
of a step boundary after a long step."""
import dataclasses
import types

import jax
import numpy as np

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.rollout import batching

from posttrain.checkpoints import policy
from posttrain.infra import mesh as mesh_lib
from posttrain.learn import learner as learner_lib
from posttrain.learn.learner import Learner, batch_shardings
from posttrain.config.plan import make_run_plan
from posttrain.types import RolloutBatch
from helpers import tiny_config


def test_batch_shardings_of_the_fields_match_those_of_a_batch():
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1, "expert": 1})
    batch = batching.random_batch(0, advantage_fn("grpo"), prompts=2, group_size=2, prompt_len=16, completion_len=4, vocab_size=50)
    template, actual = batch_shardings(mesh), batch_shardings(mesh, batch)
    for f in dataclasses.fields(RolloutBatch):
        want = getattr(actual, f.name)
        if f.default is None:  # optional (None in an assembled batch): placed as given
            assert getattr(template, f.name) is None and want is None, f.name
        else:
            assert getattr(template, f.name) == want, f.name


def test_update_then_save_and_restore(tmp_path):
    """One update, a save, a second update, then restore: back at the saved step and parameters."""
    plan = make_run_plan(tiny_config(tmp_path))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    model_config, graphdef, weights, _ = policy.load_policy(plan.policy, mesh, plan.rules)
    learner = Learner.create(plan.learner_settings, mesh, model_config, graphdef, weights, plan.step_builder())
    assert learner.restore() is None and learner.step == 0
    batch = batching.random_batch(0, advantage_fn("grpo"), prompts=4, group_size=4, prompt_len=16, completion_len=8, vocab_size=320,
                                  row_multiple=plan.row_multiple)
    m = learner.update(batch)
    assert learner.step == 1 and learner.nonfinite_run == 0
    assert np.isfinite(m["policy/loss"]) and m["optim/grad_norm"] > 0
    learner.save({"scheduler": {"seed": 0, "cursors": {}}}, force=True)
    learner.wait()
    saved = jax.device_get(learner.state.params)
    learner.update(batch)
    assert learner.step == 2
    meta = learner.restore()
    assert learner.step == 1 and meta["scheduler"] == {"seed": 0, "cursors": {}}
    assert meta["config"]["rl"]["group_size"] == 4
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(learner.state.params))):
        np.testing.assert_array_equal(a, b)
    learner.close()


def test_a_boundary_after_a_step_of_half_the_grace_saves_a_guard_checkpoint(tmp_path, monkeypatch):
    """checkpoint.stop_grace_s=2 (GUARD_FRACTION 0.5): the GRPO learner's boundaries after steps of 1.0 s and 1.5 s
    (a fake clock) are saved as guard checkpoints with their metadata, those after 0.9 s and 0.2 s are not, the
    interval's (every 4) is saved as usual; only the newest guard stays beside it, and a restore reads it."""
    now = [100.0]
    monkeypatch.setattr(learner_lib, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    plan = make_run_plan(tiny_config(tmp_path, **{"checkpoint.every_steps": 4, "checkpoint.stop_grace_s": 2.0}))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    model_config, graphdef, weights, _ = policy.load_policy(plan.policy, mesh, plan.rules)
    learner = Learner.create(plan.learner_settings, mesh, model_config, graphdef, weights, plan.step_builder())
    batch = batching.random_batch(0, advantage_fn("grpo"), prompts=4, group_size=4, prompt_len=16, completion_len=8,
                                  vocab_size=320, row_multiple=plan.row_multiple)
    saved = []
    for seconds in (0.9, 1.0, 0.2, 0.5, 1.5):  # steps 1..5
        learner.update(batch)
        now[0] += seconds
        learner.save({"scheduler": {"step": learner.step}})
        learner.wait()
        saved.append(learner.checkpointer.all_steps())
    assert saved == [[], [2], [2], [4], [4, 5]] and learner.checkpointer.guards == {2, 5}
    assert learner_lib.guard_due(1.0, 2.0) and not learner_lib.guard_due(0.99, 2.0)
    assert learner.restore()["scheduler"] == {"step": 5} and learner.step == 5
    learner.close()
