"""The evaluation gate in the GRPO loop on the tiny model (issue 22 item 7): a planted regression (one domain's
replies replaced by a wrong constant before scoring) stops the run with action=stop and only warns with
action=warn; the same policy compared with itself is "no change" (no false stop); the best checkpoint by the
trained score is kept beside checkpoint.keep; decisions in eval/gate/* metrics and summary.json; the config is
checked in the run plan."""
import json
import pathlib

import pytest

from helpers import tiny_config
from posttrain.checkpoints.orbax import Checkpointer
from posttrain.config import ConfigError
from posttrain.eval import records as records_lib
from posttrain.eval import gate_hook
from posttrain.recipes import grpo
from posttrain.config.plan import make_run_plan

# 16 rows of at most 6 new tokens a sampler call, as the tiny run's rollouts (4 prompts x 4 samples): the suite
# reuses the training sampler's programs where its temperature matches
SUITE = '''
ARITHMETIC = {"env": "posttrain/Arithmetic-v0", "kwargs": {"digits": 1, "num_test": 20}, "scorer": "last_integer",
              "format": "number"}
def get_suite():
    return {"name": "gate", "defaults": {"split": "test", "tasks": 16, "max_new_tokens": 6},
            "areas": {"arithmetic": {"trained": True, "domains": {"arithmetic": ARITHMETIC}},
                      "held out": {"domains": {"sampled": {**ARITHMETIC, "tasks": 4, "n": 4, "k": [2],
                                                           "temperature": 1.0}}}}}
'''


def gate_config(workdir, suite, **over):
    return tiny_config(workdir, **{"eval.suite": str(suite), "eval.every_steps": 1, "checkpoint.every_steps": 10,
                                   "checkpoint.keep": 1, **over})


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "gate_suite.py"
    path.write_text(SUITE)
    return path


def plant(monkeypatch, schedule):
    """Replaces the "arithmetic" replies of the n-th suite sampling (0: the baseline) by the gold answer
    (schedule[n] "gold") or a wrong constant ("wrong"), then rescores them through the env; "infra" marks every
    sample of every domain an infra_error instead."""
    real, calls = gate_hook.sample_suite, []

    def planted(plan, built, rollouter, policy):
        records, seconds = real(plan, built, rollouter, policy)
        kind = schedule[min(len(calls), len(schedule) - 1)]
        calls.append(kind)
        for r in records:
            if r["domain"] == "arithmetic":
                r["replies"] = [r["gold"] if kind == "gold" else "-7"] * len(r["replies"])
        specs = {b.domain.name: {"env_id": b.spec.id, "env_kwargs": dict(b.spec.kwargs), "scorer": b.domain.scorer,
                                 "format": b.domain.format} for b in built}
        records = records_lib.rescore(records, specs)
        if kind == "infra":  # every sample's env failed: nothing is scored
            records = [{**r, "statuses": ["infra_error"] * len(r["statuses"])} for r in records]
        return records, seconds

    monkeypatch.setattr(gate_hook, "sample_suite", planted)
    return calls


def rows(workdir):
    return {r["step"]: r for r in map(json.loads, (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())}


def test_planted_regression_stops_the_run(tmp_path, suite, monkeypatch):
    calls = plant(monkeypatch, ["gold", "wrong"])
    summary = grpo.train(gate_config(tmp_path / "run", suite, **{"train.steps": 3, "eval.gate.action": "stop"}),
                         progress=False)
    assert calls == ["gold", "wrong"] and summary["end_step"] == 1
    assert summary["stopped_early"].startswith("eval gate at step 1: regressed against the initial policy: "
                                               "arithmetic (pass@1 -1.000)")
    gate = summary["eval_gate"]
    assert [d["action"] for d in gate["decisions"]] == ["stop"] and gate["decisions"][0]["regressed"] == {
        "arithmetic": 1.0}
    m = rows(tmp_path / "run")[1]
    assert m["eval/gate/stop"] == 1.0 and m["eval/gate/regressed"] == 1.0 and m["eval/gate/arithmetic/diff"] == -1.0
    assert m["perf/eval_s"] > 0
    step_dir = tmp_path / "run" / "eval_gate" / "step_000001"
    assert {p.name for p in step_dir.iterdir()} == {"candidate", "comparison.md", "comparison.json", "forest.png",
                                                    "decision.json"}
    assert "| arithmetic | 16 | 1.000 | 0.000 |" in (step_dir / "comparison.md").read_text()
    with Checkpointer(tmp_path / "run" / "checkpoints", every_steps=1, keep=1, read_only=True) as ck:
        assert ck.all_steps() == [1]


def test_warn_trains_on_and_the_best_checkpoint_is_kept(tmp_path, suite, monkeypatch):
    """...also across a resume, which reads the baseline back instead of sampling it again."""
    calls = plant(monkeypatch, ["gold", "gold", "wrong"])
    summary = grpo.train(gate_config(tmp_path / "run", suite, **{"train.steps": 2}), progress=False)
    assert summary["end_step"] == 2 and "stopped_early" not in summary
    assert [d["action"] for d in summary["eval_gate"]["decisions"]] == ["pass", "warn"]
    assert summary["eval_gate"]["best_step"] == 1 and summary["eval_gate"]["best_score"] == 1.0
    m = rows(tmp_path / "run")
    assert (m[1]["eval/gate/warn"], m[2]["eval/gate/warn"]) == (0.0, 1.0) and m[2]["eval/gate/best_step"] == 1.0
    with Checkpointer(tmp_path / "run" / "checkpoints", every_steps=1, keep=1, read_only=True) as ck:
        assert ck.all_steps() == [1, 2]  # keep=1: the newest, and the best (step 1) beside it
    resumed = grpo.train(gate_config(tmp_path / "run", suite, **{"train.steps": 3}), progress=False)
    assert len(calls) == 4 and resumed["start_step"] == 2  # baseline, steps 1, 2 and 3: no second baseline
    assert [d["step"] for d in resumed["eval_gate"]["decisions"]] == [1, 2, 3]
    assert resumed["eval_gate"]["best_step"] == 1
    with Checkpointer(tmp_path / "run" / "checkpoints", every_steps=1, keep=1, read_only=True) as ck:
        assert ck.all_steps() == [1, 3]



def test_the_last_step_is_gated_when_every_steps_does_not_reach_it(tmp_path, suite, monkeypatch):
    """3 steps at eval.every_steps=2: the suite runs after step 2 and, at the end of the run, after step 3 (its
    regression warns); a run whose last step was gated (the tests above) samples no extra suite at its end."""
    calls = plant(monkeypatch, ["gold", "gold", "wrong"])
    summary = grpo.train(gate_config(tmp_path / "run", suite, **{"train.steps": 3, "eval.every_steps": 2}),
                         progress=False)
    assert calls == ["gold", "gold", "wrong"] and summary["end_step"] == 3
    assert [(d["step"], d["action"]) for d in summary["eval_gate"]["decisions"]] == [(2, "pass"), (3, "warn")]
    m = rows(tmp_path / "run")
    assert m[3]["eval/gate/warn"] == 1.0 and m[3]["eval/gate/arithmetic/diff"] == -1.0
    assert "eval/gate/warn" not in m[1]
    assert (tmp_path / "run" / "eval_gate" / "step_000003" / "comparison.md").exists()

def test_a_suite_with_nothing_scored_is_no_verdict_and_the_run_goes_on(tmp_path, suite, monkeypatch, caplog):
    """Every sample of step 1's suite ends in infra_error (a broken verifier): no verdict, no stop, no crash; the
    next step is gated as usual."""
    calls = plant(monkeypatch, ["gold", "infra", "wrong"])
    summary = grpo.train(gate_config(tmp_path / "run", suite, **{"train.steps": 2, "eval.gate.action": "stop"}),
                         progress=False)
    assert calls == ["gold", "infra", "wrong"] and summary["end_step"] == 2
    assert [(d["step"], d["action"]) for d in summary["eval_gate"]["decisions"]] == [(2, "stop")]
    m = rows(tmp_path / "run")
    assert m[1]["eval/gate/unscored"] == 1.0 and "eval/gate/stop" not in m[1] and m[2]["eval/gate/stop"] == 1.0
    assert "eval gate at step 1: no verdict (no task is scored on both sides" in caplog.text
    assert (tmp_path / "run" / "eval_gate" / "step_000001" / "candidate" / "records.jsonl").is_file()


def test_the_same_policy_against_itself_is_no_change(tmp_path, suite):
    plan = make_run_plan(gate_config(tmp_path / "run", suite, **{"eval.gate.action": "stop"}))
    rollouter, learner, _ = grpo.build(plan)
    try:
        gate = gate_hook.LoopGate.open(plan.gate, plan.workdir, plan.eval_settings, rollouter, learner.policy(), 0)
        decision, metrics, seconds = gate.check(0, plan.eval_settings, rollouter, learner.policy())  # again
    finally:
        learner.close()
        rollouter.close()
    assert decision.action == "pass" and decision.regressed == {} and decision.improved == ()
    assert metrics["eval/gate/sampled/diff"] == 0.0 and seconds > 0
    cmp = json.loads((tmp_path / "run" / "eval_gate" / "step_000000" / "comparison.json").read_text())
    assert cmp["counts"] == {"improved": 0, "no change": 2, "regressed": 0}


@pytest.mark.parametrize("over,match", [
    ({"eval.every_steps": 0}, "set eval.every_steps >= 1"),
    ({"eval.suite": "configs/eval/nope.py"}, "nope.py: no such file"),
    ({"eval.gate.action": "halt"}, "gate.action='halt'"),
    ({"eval.gate.max_drop": 1.5}, "gate.max_drop=1.5"),
    ({"eval.gate.alpha": 0.0}, "gate.alpha=0.0"),
])
def test_bad_gate_settings_fail_in_the_run_plan(tmp_path, suite, over, match):
    with pytest.raises(ConfigError, match=match):
        make_run_plan(gate_config(tmp_path, suite, **over))
