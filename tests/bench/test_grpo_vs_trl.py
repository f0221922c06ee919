"""Tests for bench/grpo_vs_trl.py: arguments, settings, the task order handed to TRL, and the JSON it prints.

Its quick mode (both trainers on a tiny random model) runs end to end in tests/bench/test_quick_modes.py.
"""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grpo_vs_trl", ROOT / "bench" / "grpo_vs_trl.py")
gvt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gvt)


def test_parse_args_defaults_and_flags():
    a = gvt.parse_args([])
    assert (a.json, a.quick, a.steps, a.only, a.side) == (False, False, 4, None, None)
    a = gvt.parse_args(["--json", "--quick", "--steps", "3", "--only", "trl"])
    assert (a.json, a.quick, a.steps, a.only) == (True, True, 3, "trl")


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--side", "trl"], ["--only", "jax"]])
def test_parse_args_rejects_bad_input(argv, capsys):
    with pytest.raises(SystemExit) as e:
        gvt.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err  # argparse explains


def test_settings_full_and_quick():
    s = gvt.make_settings()
    assert (s["prompts_per_step"], s["samples_per_prompt"], s["completions_per_step"], s["max_new_tokens"]) == (8, 8, 64, 24)
    assert (s["lr"], s["beta"], s["temperature"], s["dtype"], s["steps"], s["timed_steps"]) == (1e-5, 0.0, 1.0, "float32", 4, 3)
    assert s["aggregation"] == {"posttrain": "token_mean", "trl": "dapo"}
    assert s["gradient_checkpointing"] == {"trl": False, "posttrain": "dots"}
    assert gvt.make_settings(posttrain_remat="none")["gradient_checkpointing"]["posttrain"] == "none"
    q = gvt.make_settings(quick=True, steps=3)
    assert (q["prompts_per_step"], q["samples_per_prompt"], q["max_new_tokens"], q["timed_steps"]) == (2, 2, 4, 2)
    assert q["model"].startswith(gvt.QUICK_PRESET[0]) and q["dtype"] == "float32"
    json.dumps(s)  # children receive it as JSON


def test_scheduled_questions_are_posttrains_order():
    from envs.tasks.arithmetic import ArithmeticTasks
    from posttrain.scheduling.weighted_draw import WeightedDraw

    qs = gvt.scheduled_questions(steps=2, prompts_per_step=3)
    assert len(qs) == 6
    for q in qs:
        a, b = q["operands"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and q["answer"] == str(a + b)
        assert q["question"] == f"What is {a} + {b}? Answer with just the number."
    sched = WeightedDraw({"arithmetic": ArithmeticTasks("train", digits=2)}, {"arithmetic": 1.0}, seed=0)
    assert [t.task["id"] for t in sched.next_tasks(0, 3)] == [q["id"] for q in qs[:3]]
    assert [t.task["id"] for t in sched.next_tasks(1, 3)] == [q["id"] for q in qs[3:]]
    assert [q["id"] for q in qs] != [f"arithmetic-train-{i}" for i in range(6)]  # shuffled, not index order


def test_median_after_warmup():
    assert gvt.median_after_warmup([100.0, 3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="warm-up"):
        gvt.median_after_warmup([5.0])


def test_build_result_schema_and_ratio():
    s = gvt.make_settings()
    pt = {"steps_s": [30.0, 10.0, 12.0, 11.0], "peak_rss_gb": 3.5, "rewards": [0.1] * 4}
    tr = {"steps_s": [60.0, 40.0, 44.0, 50.0], "peak_rss_gb": 14.0, "trl_version": "1.16.0"}
    out = gvt.build_result(pt, tr, s, {"load_avg_end": [0.5, 0.5, 0.5]})
    assert list(out)[:len(gvt.RESULT_KEYS)] == list(gvt.RESULT_KEYS)
    assert out["posttrain_step_s"] == 11.0 and out["trl_step_s"] == 44.0 and out["ratio"] == pytest.approx(0.25)
    assert out["posttrain_steps_s"] == [10.0, 12.0, 11.0] and out["trl_warmup_s"] == [60.0]
    assert out["trl_version"] == "1.16.0" and out["settings"] is s and out["load_avg_end"] == [0.5, 0.5, 0.5]
    json.loads(json.dumps(out))
    one = gvt.build_result(pt, None, s)
    assert one["trl_step_s"] is None and one["ratio"] is None and one["posttrain_step_s"] == 11.0
    with pytest.raises(ValueError, match="expected 4 step times"):
        gvt.build_result({"steps_s": [1.0, 2.0], "peak_rss_gb": 1.0}, tr, s)


def test_same_prompts():
    qs = gvt.scheduled_questions(steps=1, prompts_per_step=2)
    texts = [q["question"] for q in qs]
    rendered = [f"<|im_start|>user\n{t}<|im_end|>\n" for t in texts]
    assert gvt.same_prompts(qs, rendered, texts)
    assert not gvt.same_prompts(qs, rendered[::-1], texts)
    assert not gvt.same_prompts(qs, rendered, texts[::-1])
    assert not gvt.same_prompts(qs, rendered[:1], texts)


def test_wait_for_quiet(monkeypatch):
    monkeypatch.setattr(gvt.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert gvt.wait_for_quiet(0.0, 100.0) < 0.5  # disabled
    assert gvt.wait_for_quiet(10.0, 100.0) < 0.5  # quiet enough
    waited = gvt.wait_for_quiet(1.5, 0.05, poll_s=0.01)  # never quiet: gives up at the cap
    assert 0.05 <= waited < 1.0
    assert gvt.parse_args(["--quiet-load", "1.5"]).quiet_load == 1.5
