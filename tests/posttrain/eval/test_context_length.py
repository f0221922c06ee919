"""The effective-context report: both length rules on hand-computed tables, Wilson intervals against statsmodels and a
NumPy formula, the counts, verdicts and heatmap of records, and the suite's skipping of buckets beyond the model."""
import json
import math

import numpy as np
import pytest
from statsmodels.stats.proportion import proportion_confint

from posttrain.eval import context_length
from posttrain.eval import suite as suite_lib

K = 1024


@pytest.mark.parametrize("accuracy,floor,threshold,effective,ruler", [
    # monotone decline: half of 0.9 is 0.45, reached up to 4k; only 1k reaches 0.85
    ({K: 0.9, 2 * K: 0.8, 4 * K: 0.6, 8 * K: 0.4, 16 * K: 0.2}, 0.0, 0.45, 4 * K, K),
    # non-monotone: 2k fails, 4k passes again: the longest passing bucket counts
    ({K: 0.6, 2 * K: 0.2, 4 * K: 0.4, 8 * K: 0.1}, 0.05, 0.3, 4 * K, None),
    # everything below floor + 0.10
    ({K: 0.1, 2 * K: 0.05}, 0.1, 0.2, None, None),
    # one bucket: it passes its own half unless it is within 0.10 of the floor
    ({K: 0.5}, 0.0, 0.25, K, None),
    ({K: 0.9}, 0.0, 0.45, K, K),
    ({K: 0.05}, 0.0, 0.1, None, None),
    # an accuracy equal to floor + 0.10 passes (0.2 + 0.1 is 0.30000000000000004 in floats)
    ({K: 0.4, 2 * K: 0.3}, 0.2, 0.3, 2 * K, None),
])
def test_effective_length_rules_on_hand_computed_tables(accuracy, floor, threshold, effective, ruler):
    assert context_length.relative_threshold(accuracy, floor) == pytest.approx(threshold)
    assert context_length.relative_effective_length(accuracy, floor) == effective
    assert context_length.ruler_effective_length(accuracy) == ruler
    assert context_length.ruler_effective_length(accuracy, threshold=0.0) == max(accuracy)


def test_relative_threshold_of_no_bucket_raises():
    with pytest.raises(ValueError, match="no bucket"):
        context_length.relative_threshold({})


def _wilson_numpy(k, n, z=1.959963984540054):
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return center - half, center + half


@pytest.mark.parametrize("k,n", [(0, 30), (21, 30), (15, 15), (7, 15), (1, 2)])
def test_wilson_interval_matches_statsmodels_and_the_formula(k, n):
    got = context_length.wilson_interval(k, n)
    assert got == pytest.approx(proportion_confint(k, n, alpha=0.05, method="wilson"), abs=1e-12)
    assert got == pytest.approx(_wilson_numpy(k, n), abs=1e-9)
    assert context_length.wilson_interval(k, n, 0.5)[1] - context_length.wilson_interval(k, n, 0.5)[0] < got[1] - got[0]
    assert all(math.isnan(x) for x in context_length.wilson_interval(0, 0))


def test_bucket_names():
    assert context_length.split_domain("doc_analysis@4k") == ("doc_analysis", 4096)
    assert context_length.split_domain("a@b@1M") == ("a@b", 1 << 20)
    assert context_length.split_domain("x@1000") == ("x", 1000)
    assert context_length.split_domain("arithmetic") is None and context_length.split_domain("x@4q") is None
    assert [context_length.bucket_label(t) for t in (1024, 4096, 131072, 1 << 20, 1000, 512)] == [
        "1k", "4k", "128k", "1M", "1000", "512"]
    assert context_length.has_buckets(["a", "b@2k"]) and not context_length.has_buckets(["a", "b"])


def _record(domain, correct, depth=None, status="ok", floor=0.0, task=iter(range(10 ** 6))):
    i = next(task)
    r = {"domain": domain, "area": domain.split("@")[0], "task_id": i, "index": i, "replies": ["x"],
         "statuses": [status], "rewards": [float(correct)], "correct": [correct], "greedy": True, "floor": floor}
    return r if depth is None else {**r, "depth": depth}


def _records():
    """doc: 1k 3/4, 2k 1/4 (one more infra error); syn: 1k 4/4, 2k 2/4 (floor 0.1); and a domain without bucket."""
    out = [_record("doc@1k", c, d) for c, d in ((True, 0.05), (True, 0.3), (True, 0.95), (False, 1.0))]
    out += [_record("doc@2k", c, d) for c, d in ((True, 0.05), (False, 0.3), (False, 0.5), (False, 0.7))]
    out.append(_record("doc@2k", False, 0.1, status="infra_error"))
    out += [_record("syn@1k", True, 0.1 * i, floor=0.1) for i in range(4)]
    out += [_record("syn@2k", i < 2, 0.1 * i, floor=0.1) for i in range(4)]
    return out + [_record("arithmetic", True)]


def test_counts_summaries_and_pooling_of_records():
    counts = context_length.bucket_counts(_records())
    assert counts == {"doc": {K: {"tasks": 4, "correct": 3, "samples": 4, "floor": 0.0},
                              2 * K: {"tasks": 4, "correct": 1, "samples": 4, "floor": 0.0}},
                      "syn": {K: {"tasks": 4, "correct": 4, "samples": 4, "floor": 0.1},
                              2 * K: {"tasks": 4, "correct": 2, "samples": 4, "floor": 0.1}}}
    doc = context_length.length_summary(counts["doc"])
    assert (doc["threshold"], doc["effective_bucket"], doc["ruler_bucket"]) == (0.375, "1k", None)
    assert [r["accuracy"] for r in doc["buckets"]] == [0.75, 0.25]
    assert doc["buckets"][0]["ci"] == pytest.approx(list(proportion_confint(3, 4, method="wilson")))
    syn = context_length.length_summary(counts["syn"])
    assert (syn["floor"], syn["threshold"], syn["effective_tokens"], syn["ruler_tokens"]) == (0.1, 0.5, 2 * K, K)
    pooled = context_length.pooled_counts(counts)
    assert pooled[K] == {"tasks": 8, "correct": 7, "samples": 8, "floor": pytest.approx(0.05)}
    assert context_length.length_summary(pooled)["effective_bucket"] == "1k"  # 3/8 < max(0.1 + 0.1, 7/16)


def _comparison():
    row = lambda d, v, diff: {"domain": d, "verdict": v, "pass@1": {"diff": diff, "ci": [diff - 0.1, diff + 0.1],
                                                                    "p_holm": 0.5}}
    return {"domains": [row("doc@2k", "regressed", -0.5), row("doc@1k", "no change", 0.0),
                        row("syn@1k", "no change", 0.25), row("arithmetic", "improved", 0.5)]}


def test_verdicts_are_grouped_by_bucket():
    v = context_length.verdicts_by_bucket(_comparison())
    assert list(v) == ["1k", "2k"] and v["1k"]["counts"] == {"no change": 2}
    assert v["2k"]["families"] == {"doc": {"verdict": "regressed", "diff": -0.5, "ci": [-0.6, -0.4], "p_holm": 0.5}}


def test_depth_table_and_heatmap_png(tmp_path):
    table = context_length.depth_table(_records(), bins=2)
    buckets, correct, samples = table["doc"]
    assert buckets == [K, 2 * K] and list(table) == ["doc", "syn", "all"]
    assert samples.tolist() == [[2, 2], [2, 2]] and correct.tolist() == [[2, 1], [1, 0]]  # depth 1.0: the last bin
    assert table["all"][2].sum() == 16  # the infra error and the domain without a bucket are left out
    path = context_length.heatmap(_records(), tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    no_depth = [{k: v for k, v in r.items() if k != "depth"} for r in _records()]
    empty = context_length.depth_table(no_depth)
    assert list(empty) == ["all"] and empty["all"][0] == [] and empty["all"][2].shape == (5, 0)
    assert context_length.heatmap(no_depth, tmp_path / "empty.png").is_file()


def test_the_report_files(tmp_path):
    evaluations = {"baseline": {"label": "base", "step": 0, "records": _records()},
                   "candidate": {"label": "run", "step": 3, "records": _records()}}
    skipped = {"doc@4k": "too long: ...", "gsm8k": "data absent: ..."}
    text = context_length.write_context_report(tmp_path, evaluations, skipped, _comparison())
    report = json.loads((tmp_path / context_length.JSON_FILE).read_text())
    assert set(report) == {"rule", "ruler_rule", "ruler_threshold", "confidence", "evaluations", "skipped", "heatmap",
                           "verdicts"}
    assert report["skipped"] == {"doc@4k": "too long: ..."} and report["ruler_threshold"] == 0.85
    assert set(report["evaluations"]["candidate"]["families"]) == {"doc", "syn", "all"}
    assert report["evaluations"]["candidate"]["families"]["syn"]["effective_bucket"] == "2k"
    assert (tmp_path / context_length.MARKDOWN_FILE).read_text() == text
    assert (tmp_path / context_length.HEATMAP_FILE).is_file()
    assert "| doc | 0.75 [0.30, 0.95] | 0.25 [0.05, 0.70] | skipped | 1k (>= 0.38) | none |" in text
    assert "| 2k | doc regressed (-0.500) | regressed 1 |" in text and "doc@4k (too long: ...)" in text


def _suite(**doc):
    return suite_lib.parse_suite({"areas": {"long": {"domains": {
        "doc@1k": {"env": "posttrain/DocAnalysis-v0", "kwargs": {"target_tokens": 1024}, "max_new_tokens": 32},
        "doc@4k": {"env": "posttrain/DocAnalysis-v0", "kwargs": {"target_tokens": 4096}, "max_new_tokens": 32},
        "arith": {"env": "posttrain/Arithmetic-v0", **doc}}}}})


def test_domains_beyond_the_models_positions_are_skipped_with_the_reason():
    suite = _suite()
    assert [suite_lib.positions_needed(d) for d in suite.domains] == [1024 + 32 + suite_lib.TEMPLATE_MARGIN,
                                                                      4096 + 32 + suite_lib.TEMPLATE_MARGIN, None]
    fit, skipped = suite_lib.fit_positions(suite, 2048)
    assert [d.name for d in fit.domains] == ["doc@1k", "arith"]
    assert skipped == {"doc@4k": "too long: 4,096-token prompts exceed the model's 2,048 positions (4,192 with the "
                                 "reply and chat template)"}
    assert suite_lib.fit_positions(suite, 4192)[1] == {}
    fit, skipped = suite_lib.fit_positions(_suite(min_positions=4096), 2048)
    assert skipped["arith"] == "too long: needs 4,096 positions (min_positions), the model has 2,048"
    with pytest.raises(ValueError, match="min_positions=0 must be an int >= 1"):
        _suite(min_positions=0)
