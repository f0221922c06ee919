"""posttrain.eval.report: the Markdown table, the JSON-able dict and the PNG forest plot of a comparison."""
import json

import numpy as np
import pytest

from posttrain.eval.compare import compare
from posttrain.eval.report import comparison_dict, comparison_markdown, forest_plot


def _evals():
    rng = np.random.default_rng(5)
    base, cand = [], []
    for domain, shift in (("arith", 0.0), ("gcd", -0.6)):
        b = rng.integers(0, 2, 40)
        c = b * (rng.random(40) >= -shift)  # gcd: each solved task lost with probability 0.6
        for t in range(40):
            base.append({"domain": domain, "task_id": t, "prompt": f"{domain}{t}", "rewards": [float(b[t])]})
            cand.append({"domain": domain, "task_id": t, "prompt": f"{domain}{t}", "rewards": [float(c[t])]})
    return compare(base, cand, n_resamples=999)


def test_dict_is_json_able_and_complete():
    result = _evals()
    d = json.loads(json.dumps(comparison_dict(result)))
    assert d["tasks"] == 80 and d["task_set_hash"] == result.task_set_hash and d["alpha"] == 0.05
    rows = {r["domain"]: r for r in d["domains"]}
    assert rows["gcd"]["verdict"] == "regressed" and rows["arith"]["verdict"] == "no change"
    assert rows["gcd"]["pass@1"]["ci"] == list(result.domains[1].pass_at_1.ci)
    assert set(rows["gcd"]["pass@1"]) == {"baseline", "candidate", "diff", "ci", "mde", "test", "p", "p_holm",
                                          "verdict", "ci_adjusted"}
    assert rows["gcd"]["pass@1"]["ci_adjusted"] == list(result.domains[1].pass_at_1.ci_adjusted)
    assert d["counts"] == {"improved": 0, "no change": 1, "regressed": 1}


def test_markdown_table():
    result = _evals()
    md = comparison_markdown(result)
    lines = md.strip().splitlines()
    assert "80 tasks in 2 domains" in lines[0] and result.task_set_hash[:12] in lines[0]
    rows = [ln for ln in lines if ln.startswith("| arith") or ln.startswith("| gcd")]
    assert len(rows) == 2 and "**regressed**" in rows[1] and "**no change**" in rows[0]
    assert all(ln.count("|") == lines[2].count("|") for ln in lines[2:])  # every row has every column


def test_forest_plot_writes_png(tmp_path):
    result = _evals()
    path = forest_plot(result, tmp_path / "plots" / "forest.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    forest_plot(result, tmp_path / "reward.png", metric="mean_reward")
    with pytest.raises(ValueError, match="metric"):
        forest_plot(result, tmp_path / "x.png", metric="accuracy")
