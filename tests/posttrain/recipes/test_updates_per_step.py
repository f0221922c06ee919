"""Several optimizer updates per train step (rl.ppo_epochs x rl.minibatches): the loop, the policy version, the
checkpoints and resume count train steps, not updates."""
import json

from helpers import tiny_config
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.recipes import grpo
from posttrain.scheduling import archive


def test_ppo_epochs_run_trains_every_step_at_staleness_zero_and_resumes(tmp_path):
    over = {"rl.ppo_epochs": 2, "train.steps": 3, "checkpoint.every_steps": 1}
    summary = grpo.train(tiny_config(tmp_path, **over), progress=False)
    assert summary["end_step"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "policy/loss" in r]
    assert len(trained) == 3 and len(set(trained)) == 3, trained
    with Checkpointer(tmp_path / "checkpoints", every_steps=1, keep=3, read_only=True) as ck:
        assert ck.latest_step() == 3
    table = archive.read(tmp_path)
    steps, versions = table["step"].to_pylist(), table["policy_version"].to_pylist()
    assert sorted(set(steps)) == [0, 1, 2]
    assert versions == steps  # max_staleness 0: batch s is sampled by the policy after s train steps
    summary = grpo.train(tiny_config(tmp_path, **{**over, "train.steps": 4}), progress=False)
    assert (summary["start_step"], summary["end_step"]) == (3, 4)
