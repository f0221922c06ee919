"""Training faults the loop must survive or stop on cleanly: non-finite steps are skipped, logged and counted,
and a run of them stops with a checkpoint; truncated-sampling warning; the curriculum across a resume."""
import json
import pathlib

import pytest

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.recipes import grpo as loop
from posttrain.recipes.run_plan import make_run_plan, truncation_warning
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import from_config_dict
from helpers import tiny_config


def test_consecutive_nonfinite_steps_stop_the_run_with_a_checkpoint(tmp_path, caplog):
    """lr = 1e30 with weight decay blows the weights up at the first update (even with all-zero advantages); every
    later loss is NaN and is skipped."""
    cfg = tiny_config(tmp_path, **{"optim.lr": 1e30, "optim.weight_decay": 0.1, "train.steps": 10,
                                   "train.max_nonfinite_skips": 2, "checkpoint.every_steps": 100})
    with pytest.raises(loop.NonFiniteError, match=r"2 consecutive steps had a non-finite"):
        loop.train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r.get("policy/skipped_nonfinite") == 1.0]
    assert len(skipped) == 2 and skipped[-1] == rows[-1]["step"] < 10
    assert Checkpointer(tmp_path / "checkpoints", every_steps=1, keep=2, read_only=True).latest_step() == skipped[-1]
    assert sum("update skipped" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("top_p,top_k,warned", [
    (1.0, 0, False), (0.9, 0, True), (0.999, 0, True), (1.0, 20, True), (1.0, 1, True), (0.95, 50, True)])
def test_truncated_sampling_warns(top_p, top_k, warned):
    """Any truncation of the training rollouts' distribution (top-p < 1 or top-k > 0) is warned about, once, in the
    run plan; the full distribution is not."""
    cfg = tiny_config("/tmp/x", **{"sampling.top_p": top_p, "sampling.top_k": top_k})
    warnings = make_run_plan(cfg).warnings
    assert len(warnings) == int(warned) and (truncation_warning(cfg) is not None) == warned
    if warned:
        assert f"top_p={top_p}" in warnings[0] and f"top_k={top_k}" in warnings[0] and "rl.tis_cap" in warnings[0]


@pytest.mark.slow  # ~1-2 min: several sampler compiles as prompts change with the level
def test_curriculum_moves_levels_in_the_loop_and_resumes(tmp_path):
    """chain_sum starts at level 2; a random tiny model passes nothing, so with window = min_episodes = 16 (one
    step's episodes) the level falls one step per step, the env specs follow, and a resumed run keeps it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reasoning_tiny", pathlib.Path(__file__).resolve().parents[3]
                                                  / "configs" / "reasoning_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    chain = c.env.train["reasoning_gym/chain_sum"]
    chain.kwargs.level = 2
    c.env.train = {"reasoning_gym/chain_sum": chain}
    c.env.eval = {}
    c.eval.at_start = c.eval.at_end = False
    c.curriculum.enabled, c.curriculum.window, c.curriculum.min_episodes = True, 16, 16
    c.train.workdir, c.checkpoint.async_save, c.checkpoint.every_steps = str(tmp_path), False, 1
    c.sampling.max_new_tokens = 4
    for steps in (2, 3):
        c.train.steps = steps
        loop.train(from_config_dict(c), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    levels = [r["curriculum/reasoning_gym/chain_sum/level"] for r in rows if "curriculum/reasoning_gym/chain_sum/level" in r]
    moves = [r["curriculum/reasoning_gym/chain_sum/moves"] for r in rows if "curriculum/reasoning_gym/chain_sum/moves" in r]
    assert levels == [1.0, 0.0, 0.0] and moves == [1.0, 2.0, 2.0]  # step 3 ran after a resume: state restored


def test_skips_are_counted_in_a_row_reset_by_a_finite_update_and_logged_with_the_step(tmp_path, caplog):
    """The loop stops on `learner.nonfinite_run`: consecutive skips only (a finite update in between resets it)."""
    import numpy as np

    from posttrain.rollout import batching

    from posttrain.checkpoints import policy as setup
    from posttrain.infra import mesh as mesh_lib
    from posttrain.learn.learner import Learner

    plan = make_run_plan(tiny_config(tmp_path))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    model_config, graphdef, weights, _ = setup.load_policy(plan.policy, mesh, plan.rules)
    learner = Learner.create(plan.learner, mesh, model_config, graphdef, weights, loop.step_builder(plan))
    good = batching.random_batch(0, advantage_fn("grpo"), prompts=4, group_size=4, prompt_len=16, completion_len=8, vocab_size=320,
                                 row_multiple=plan.rollout.row_multiple)
    bad = good.replace(advantages_N=np.where(np.arange(len(good.advantages_N)) == 1, np.nan, good.advantages_N))
    runs, skipped = [], []
    for batch in (bad, good, bad, bad, good):
        skipped.append(learner.update(batch)["policy/skipped_nonfinite"])
        runs.append(learner.nonfinite_run)
    learner.close()
    assert (runs, skipped) == ([1, 0, 1, 2, 0], [1.0, 0.0, 1.0, 1.0, 0.0])
    lines = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 3", "step 4"], lines
    assert lines[-1].endswith("(2 in a row)")


# issue 29 item 3, kind: every output a run appends to is cut back to the step it (re)starts from (0: nothing kept)
@pytest.mark.parametrize("start,trajectories,evals,metrics", [
    (0, [], [], []),  # killed after step 1 before the first checkpoint: the rerun starts over
    (1, [0], [0], [0, 1]),  # trajectories/step_0 are the rollouts of update 1; eval/step_2 is past checkpoint 1
    (2, [0, 1], [0, 2], [0, 1, 2]),  # eval/step_2 ran before checkpoint 2 was written: kept
    (9, [0, 1, 2, 3], [0, 2, 4], [0, 1, 2, 3, 4]),  # nothing recorded past the checkpoint: nothing cut
])
def test_open_outputs_cuts_every_appended_output_back_to_the_start(tmp_path, start, trajectories, evals, metrics):
    from posttrain.infra.metrics import MetricsWriter, read_metrics

    with MetricsWriter(tmp_path, plot=False, tensorboard=False) as w:
        for s in range(5):
            w.write(s, {"reward/mean": 0.5})
    for folder, steps in (("trajectories", range(4)), ("eval", (0, 2, 4))):
        (tmp_path / folder).mkdir()
        for s in steps:
            (tmp_path / folder / f"step_{s:06d}.jsonl").write_text("{}\n")
    loop.open_outputs(tmp_path, start).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == metrics
    for folder, want in (("trajectories", trajectories), ("eval", evals)):
        assert sorted(int(p.stem[5:]) for p in (tmp_path / folder).glob("step_*.jsonl")) == want, folder
