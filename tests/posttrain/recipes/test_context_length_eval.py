"""`posttrain eval --suite=configs/eval/long_context.py` on the tiny model (2,048 positions), the synthetic family:
its 1k bucket is sampled against the base policy, its buckets up to 1M, beyond the model's positions, are listed as
skipped with the reason, and the effective-context report is written beside the comparison. (One family: a 1k
prompt is about 4,100 of the byte tokenizer's tokens, and prefilling three families' doubles the test's time.)"""
import json

import pytest
from absl.testing import flagsaver

from helpers import tiny_config
from posttrain import cli
from posttrain.config.plan import make_run_plan
from posttrain.eval import context_length
from posttrain.eval import records as records_lib
from posttrain.recipes import grpo

BEYOND = ("2k", "4k", "8k", "16k", "32k", "64k", "128k", "1M")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A tiny run with 2,048 positions whose only checkpoint is its initial policy (no train step compiled)."""
    workdir = tmp_path_factory.mktemp("long_run")
    cfg = tiny_config(workdir, **{"model.overrides": {"vocab_size": 320, "max_position": 2048}})
    rollouter, learner, _ = grpo.build(make_run_plan(cfg))
    learner.save(rollouter.state_dict(), force=True)
    learner.wait()
    learner.close()
    rollouter.close()
    return workdir


@pytest.mark.slow  # 23 s of CPU prefill; the CI tiers cover skipping (eval/test_context_length.py) and the
# report files from fixed records; this end-to-end run is the full tier's
def test_long_context_suite_skips_buckets_beyond_the_model_and_writes_the_report(long_run, tmp_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.setenv("POSTTRAIN_XLA_CACHE", "0")
    out = tmp_path / "report"
    with flagsaver.flagsaver():  # absl flags keep their values between in-process calls
        assert cli.main(["posttrain", "eval", "--suite=configs/eval/long_context.py", f"--checkpoint={long_run}",
                         "--baseline=base", "--limit=2", "--domains=synthetic@*", f"--out={out}"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert list(result["skipped"]) == [f"synthetic@{b}" for b in BEYOND]
    assert result["skipped"]["synthetic@1M"] == ("too long: 1,048,576-token prompts exceed the model's 2,048 positions "
                                                "(1,048,672 with the reply and chat template)")
    assert result["counts"] == {"improved": 0, "no change": 1, "regressed": 0}  # the same policy twice
    records, _ = records_lib.read_evaluation(out / "candidate")
    assert [r["domain"] for r in records] == ["synthetic@1k"] * 2
    assert all(0.0 <= r["depth"] <= 1.0 for r in records)  # the env's evidence depth, through its info
    files = {p.name for p in out.iterdir()}
    assert {context_length.JSON_FILE, context_length.MARKDOWN_FILE, context_length.HEATMAP_FILE} <= files
    report = json.loads((out / context_length.JSON_FILE).read_text())
    assert set(report) == {"rule", "ruler_rule", "ruler_threshold", "confidence", "evaluations", "skipped", "heatmap",
                           "verdicts"}
    assert set(report["evaluations"]) == {"baseline", "candidate"} and report["skipped"] == result["skipped"]
    families = report["evaluations"]["candidate"]["families"]
    assert set(families) == {"synthetic", "all"} and [b["bucket"] for b in families["all"]["buckets"]] == ["1k"]
    assert set(families["synthetic"]) >= {"floor", "threshold", "effective_bucket", "ruler_bucket", "buckets"}
    assert families["synthetic"]["buckets"][0]["samples"] == 2 and families["synthetic"]["floor"] == 0.0
    assert list(report["verdicts"]) == ["1k"] and report["verdicts"]["1k"]["counts"] == {"no change": 1}
    md = (out / context_length.MARKDOWN_FILE).read_text()
    assert "| synthetic |" in md and "| skipped |" in md and md in printed
    assert (out / context_length.HEATMAP_FILE).read_bytes()[:4] == b"\x89PNG"
