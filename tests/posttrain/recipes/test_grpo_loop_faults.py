"""Training faults the loop must survive or stop on cleanly: non-finite steps are skipped, logged and counted,
and a run of them stops with a checkpoint; truncated-sampling warning; the curriculum across a resume."""
import json
import pathlib

import pytest

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.recipes import grpo
from posttrain.config.plan import make_run_plan, sampling_warnings
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import from_config_dict
from helpers import tiny_config


def test_consecutive_nonfinite_steps_stop_the_run_with_a_checkpoint(tmp_path, caplog):
    """lr = 1e30 with weight decay blows the weights up at the first update (even with all-zero advantages); every
    later loss is NaN and is skipped."""
    cfg = tiny_config(tmp_path, **{"optim.lr": 1e30, "optim.weight_decay": 0.1, "train.steps": 10,
                                   "train.max_nonfinite_skips": 2, "checkpoint.every_steps": 100})
    with pytest.raises(grpo.NonFiniteError, match=r"2 consecutive steps had a non-finite"):
        grpo.train(cfg, progress=False)
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
    warnings = [w for w in make_run_plan(cfg).warnings if "truncate" in w]
    assert len(warnings) == int(warned) and any("truncate" in w
                                                for w in sampling_warnings(cfg)) == warned
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
        grpo.train(from_config_dict(c), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    levels = [r["curriculum/reasoning_gym/chain_sum/level"] for r in rows if "curriculum/reasoning_gym/chain_sum/level" in r]
    moves = [r["curriculum/reasoning_gym/chain_sum/moves"] for r in rows if "curriculum/reasoning_gym/chain_sum/moves" in r]
    assert levels == [1.0, 0.0, 0.0] and moves == [1.0, 2.0, 2.0]  # step 3 ran after a resume: state restored


def test_skips_are_counted_in_a_row_reset_by_a_finite_update_and_logged_with_the_step(tmp_path, caplog):
    """The loop stops on `learner.nonfinite_run`: consecutive skips only (a finite update in between resets it)."""
    import numpy as np

    from posttrain.rollout import batching

    from posttrain.checkpoints import policy as policy_lib
    from posttrain.infra import mesh as mesh_lib
    from posttrain.learn.learner import Learner

    plan = make_run_plan(tiny_config(tmp_path))
    mesh = mesh_lib.make_mesh(plan.mesh_shape)
    model_config, graphdef, weights, _ = policy_lib.load_policy(plan.policy, mesh, plan.rules)
    learner = Learner.create(plan.learner_settings, mesh, model_config, graphdef, weights, plan.step_builder())
    good = batching.random_batch(0, advantage_fn("grpo"), prompts=4, group_size=4, prompt_len=16, completion_len=8, vocab_size=320,
                                 row_multiple=plan.row_multiple)
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


# every output a run appends to is cut back to the step it (re)starts from (0: nothing kept)
@pytest.mark.parametrize("start,archived,evals,metrics", [
    (0, [], [], []),  # killed after step 1 before the first checkpoint: the rerun starts over
    (1, [0], [0], [0, 1]),  # archive/step_0 holds the rollouts of update 1; eval/step_2 is past checkpoint 1
    (2, [0, 1], [0, 2], [0, 1, 2]),  # eval/step_2 ran before checkpoint 2 was written: kept
    (9, [0, 1, 2, 3], [0, 2, 4], [0, 1, 2, 3, 4]),  # nothing recorded past the checkpoint: nothing cut
])
def test_open_outputs_cuts_every_appended_output_back_to_the_start(tmp_path, start, archived, evals, metrics):
    from posttrain.infra.metrics import MetricsWriter, read_metrics

    with MetricsWriter(tmp_path, plot=False, tensorboard=False) as w:
        for s in range(5):
            w.write(s, {"reward/mean": 0.5})
    from posttrain.scheduling import archive

    for s in range(4):
        archive.write_step(tmp_path, s, [])
    (archive.archive_dir(tmp_path) / ".step_00000004.7.tmp").write_bytes(b"PAR1")  # a write killed midway
    (tmp_path / "eval").mkdir()
    for s in (0, 2, 4):
        (tmp_path / "eval" / f"step_{s:06d}.jsonl").write_text("{}\n")
    grpo.open_outputs(tmp_path, start).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == metrics
    assert sorted(p.name for p in archive.archive_dir(tmp_path).iterdir()) == [
        f"step_{s:08d}.parquet" for s in archived]
    assert sorted(int(p.stem[5:]) for p in (tmp_path / "eval").glob("step_*.jsonl")) == evals


@pytest.fixture
def fast_policy(monkeypatch):
    """load_policy without its init compile: the preset's weights drawn with numpy (helpers.random_model)."""
    from helpers import random_model
    from posttrain.model.tokenizer import Tokenizer

    def load(source, mesh, rules):
        return (*random_model(source.preset, **dict(source.fields), **dict(source.overrides)),
                Tokenizer.byte_level())

    monkeypatch.setattr(grpo, "load_policy", load)


def two_checkpoint_run(workdir, damage):
    """A run with checkpoints 1 and 2 (states of steps 1 and 2), then step 2 damaged as `damage` says."""
    import glob
    import os

    import jax.numpy as jnp

    plan = make_run_plan(tiny_config(workdir))
    rollouter, learner, _ = grpo.build(plan)
    meta = {**rollouter.state_dict(), "config": plan.config_dict}
    for s in (1, 2):
        learner.checkpointer.save(s, learner.state.replace(step=jnp.asarray(s, learner.state.step.dtype)), meta,
                                  force=True)
    learner.close()
    rollouter.close()
    step2 = workdir / "checkpoints" / "2"
    if damage == "truncated_arrays":
        for f in glob.glob(str(step2 / "state" / "**" / "d" / "*"), recursive=True):
            os.truncate(f, os.path.getsize(f) // 2)
    elif damage == "truncated_manifest":
        os.truncate(step2 / "manifest" / "metadata", 3)
    elif damage == "bad_meta_json":
        (step2 / "meta" / "metadata").write_text('{"scheduler": ')
    return plan


def tree(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


# commands that read a run (eval, convert) never change it; training moves an unreadable
# checkpoint aside and says so loudly (one ERROR line naming the steps, where they went and what is trained again)
@pytest.mark.parametrize("damage", ["truncated_arrays", "truncated_manifest", "bad_meta_json"])
def test_readers_leave_an_unreadable_checkpoint_in_place_and_training_moves_it_loudly(tmp_path, fast_policy,
                                                                                      monkeypatch, caplog, damage):
    plan = two_checkpoint_run(tmp_path, damage)
    before = tree(tmp_path)
    monkeypatch.setattr(grpo.eval_runner, "run", lambda *a: ({"eval/accuracy": 0.5}, [{"reward": 1.0}]))  # no sampler
    step, _ = grpo.evaluate_run(plan)
    _, state, _ = grpo.run_policy(plan)
    assert step == 1 and tree(tmp_path) == before  # nothing renamed, written or created
    using = [r.getMessage() for r in caplog.records if r.getMessage().startswith("USING STEP 1, NOT 2")]
    assert len(using) == 2 and all("left in place" in m for m in using), using
    caplog.clear()
    rollouter, learner, _ = grpo.build(plan)  # what training does at its start
    learner.close()
    rollouter.close()
    assert learner.step == 1 and [r["step"] for r in learner.checkpointer.unreadable] == [2]
    moved = learner.checkpointer.unreadable[0]["moved_to"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", pathlib.Path(moved).name]
    loud = [r for r in caplog.records if r.getMessage().startswith("RESUMING FROM STEP 1, NOT 2")]
    assert len(loud) == 1 and loud[0].levelname == "ERROR" and moved in loud[0].getMessage()
    assert "steps 2..2 are trained again" in loud[0].getMessage()


def test_a_run_with_no_readable_checkpoint_is_one_error_for_readers_and_the_cli(tmp_path, fast_policy, monkeypatch,
                                                                                  capsys):
    """Every checkpoint unreadable: eval and convert raise CheckpointCorruptError naming each step (never the base
    model as step 0) and change nothing; the CLI prints it as one line with exit code 2."""
    from posttrain import cli
    from posttrain.checkpoints.orbax import CheckpointCorruptError

    plan = two_checkpoint_run(tmp_path, "truncated_manifest")
    (tmp_path / "checkpoints" / "1" / "manifest" / "metadata").write_text('{"format": 1, "lea')
    before = tree(tmp_path)
    for reader in (grpo.evaluate_run, grpo.run_policy):
        with pytest.raises(CheckpointCorruptError, match=r"no usable checkpoint in .*\n  step 2: .*\n  step 1: "):
            reader(plan)
    assert tree(tmp_path) == before

    def eval_cmd(f):
        return grpo.evaluate_run(plan)

    monkeypatch.setitem(cli.COMMANDS, "eval", eval_cmd)
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")  # main() would turn the persistent compilation cache on
    config = pathlib.Path(__file__).resolve().parents[3] / "configs" / "tiny.py"
    assert cli.main(["posttrain", "eval", f"--config={config}", f"--checkpoint={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no usable checkpoint in ") and "step 1:" in err[-1]


# kind: a run that cannot learn says so, with the reason: every group's rewards equal for N steps in a row
@pytest.mark.parametrize("run,mean,expect", [
    (0, 0.0, None), (1, 0.0, None), (grpo.ZERO_VARIANCE_WARN_STEPS - 1, 0.0, None),
    (grpo.ZERO_VARIANCE_WARN_STEPS, 0.0, "every reply fails"),
    (grpo.ZERO_VARIANCE_WARN_STEPS, 1.0, "every reply succeeds"),
    (grpo.ZERO_VARIANCE_WARN_STEPS, 0.5, "the rewards do not vary within a group"),
    (grpo.ZERO_VARIANCE_WARN_STEPS + 1, 0.0, None), (2 * grpo.ZERO_VARIANCE_WARN_STEPS, 0.0, "every reply fails"),
])
def test_zero_variance_steps_are_warned_about_with_the_reason(run, mean, expect):
    warning = grpo.zero_variance_warning(run, {"reward/mean": mean, "frac_zero_std_groups": 1.0})
    if expect is None:
        assert warning is None
    else:
        assert expect in warning and f"{run} steps in a row" in warning and "zero policy gradient" in warning


# kind: every resource a run opens is closed in reverse order on any failure, and the first error is the last word
@pytest.mark.parametrize("error,failing,raised,warned", [
    (None, [], None, []),
    (None, ["b"], "b failed", []),  # no error in flight: the close error is raised, after every close ran
    (None, ["b", "a"], "b failed", ["closing a after OSError failed too: OSError: a failed"]),
    (RuntimeError("first"), [], "first", []),
    (RuntimeError("first"), ["c", "a"], "first", ["closing c after RuntimeError failed too: OSError: c failed",
                                                  "closing a after RuntimeError failed too: OSError: a failed"]),
])
def test_resources_close_in_reverse_order_and_keep_the_first_error(error, failing, raised, warned, caplog):
    calls = []

    def closer(name):
        def close():
            calls.append(name)
            if name in failing:
                raise OSError(f"{name} failed")
        return close

    def run():
        with grpo.Resources(("a", closer("a"))) as res:
            res.push("b", closer("b"))
            res.push("c", closer("c"))
            if error is not None:
                raise error

    if raised is None:
        run()
    else:
        with pytest.raises(Exception, match=raised):
            run()
    assert calls == ["c", "b", "a"]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("closing")] == warned


def test_a_failed_start_after_the_learner_closes_the_checkpointer(tmp_path, fast_policy, monkeypatch):
    """Rollouter.create fails (the env workers cannot start) after the learner (and its orbax manager) exists: the
    checkpointer is closed before the error propagates (left open, orbax's threads printed "cannot schedule new
    futures after shutdown" after the real traceback)."""
    from posttrain.learn.learner import Learner

    made, create = [], Learner.create
    monkeypatch.setattr(Learner, "create", classmethod(lambda cls, *a, **k: made.append(create(*a, **k)) or made[-1]))

    def no_workers(*a, **k):
        raise RuntimeError("env workers could not start")

    monkeypatch.setattr(grpo.Rollouter, "create", no_workers)
    with pytest.raises(RuntimeError, match="env workers could not start"):
        grpo.build(make_run_plan(tiny_config(tmp_path)))
    assert made and made[0].checkpointer._manager is None  # closed


def test_a_failing_step_closes_everything_in_reverse_order_and_raises_its_own_error(tmp_path, fast_policy,
                                                                                     monkeypatch, caplog):
    from posttrain.infra import metrics as metrics_lib
    from posttrain.learn.learner import Learner

    order = []
    for cls, name in ((metrics_lib.ProgressBar, "bar"), (metrics_lib.MetricsWriter, "writer"),
                      (grpo.Rollouter, "env workers"), (Learner, "checkpointer")):
        def close(self, _real=cls.close, _name=name):
            order.append(_name)
            _real(self)
            if _name == "writer":
                raise OSError("disk full")  # a teardown error while the step's error propagates
        monkeypatch.setattr(cls, "close", close)

    def boom(self, step, policy, rng, **kw):
        raise RuntimeError("the sampler failed")

    monkeypatch.setattr(grpo.Rollouter, "collect", boom)
    with pytest.raises(RuntimeError, match="the sampler failed"):
        grpo.train(tiny_config(tmp_path), progress=False)
    assert order == ["bar", "writer", "env workers", "checkpointer"]
    assert any("closing the metrics writer after RuntimeError failed too: OSError: disk full" in r.getMessage()
               for r in caplog.records)


def test_an_allowed_resume_with_changes_records_them_with_the_step(tmp_path, fast_policy, monkeypatch):
    import json

    from posttrain.config import ConfigError

    two_checkpoint_run(tmp_path, None)
    changed = make_run_plan(tiny_config(tmp_path, **{"optim.lr": 5e-4}))
    loads = []
    monkeypatch.setattr(grpo, "load_policy", lambda *a, _load=grpo.load_policy: loads.append(1) or _load(*a))
    with pytest.raises(ConfigError, match=r"\(checkpoint 2\) with changed settings: optim.lr: 0.001 -> 0.0005; "):
        grpo.build(changed)
    assert not loads  # refused before any model load
    rollouter, learner, _ = grpo.build(changed, allow_config_change=True)
    learner.close()
    rollouter.close()
    assert [json.loads(line) for line in (tmp_path / "config_changes.jsonl").read_text().splitlines()] == [
        {"step": 2, "changes": {"optim.lr": [0.001, 0.0005]}}]
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 5e-4
